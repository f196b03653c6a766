"""A training loop with a tqdm progress bar, as users write one: 10,000 steps, the bar redrawn in place (`\\r`, no
newline) after every step. Halfway it stops until the file named by its argument `GO` exists, after saying so in
`HALFWAY` (the test reads the agent's memory and output while the bar stands there), then runs to the end."""

import sys
import time
from pathlib import Path

from tqdm import tqdm

import libworker as hvd

halfway, go = Path(sys.argv[1]), Path(sys.argv[2])
hvd.init()
for step in tqdm(range(10_000), desc="train", mininterval=0, miniters=1):
    if step == 5_000:
        halfway.touch()
        while not go.exists():
            time.sleep(0.05)
print("trained 10000 steps", flush=True)
