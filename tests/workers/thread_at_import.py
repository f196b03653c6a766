"""A module that starts a thread when it is imported, as some libraries do (a metrics flusher, a watchdog): not safe
to import into a fork server (`--preload tests.workers.thread_at_import`)."""

import threading

flusher_stop = threading.Event()
threading.Thread(target=flusher_stop.wait, name="metrics-flusher", daemon=True).start()
