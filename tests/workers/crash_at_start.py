"""examples/train_elastic.py, except that a process started on $CRASH_ON_HOST while the file $CRASH_AT_START_IF
exists dies at start-up (exit 9): a slot that crashes on every start."""

import os
import runpy
import sys
from pathlib import Path

if os.environ.get("ELASTIC_HOST") == os.environ["CRASH_ON_HOST"] and Path(os.environ["CRASH_AT_START_IF"]).exists():
    sys.exit(9)
sys.argv[0] = str(Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py")
runpy.run_path(sys.argv[0], run_name="__main__")
