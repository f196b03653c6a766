"""The processes an agent starts for a slot, below libworker and without torch: how they reach their agent
(agent_link), enter rounds (rounds), are forked warm and run their script (forking, warm_start); and the torchrun-mode
slot supervisor (torchrun_slot, with its command_seed and round_store). Not under libworker/, whose import loads
torch and binds the GPU: a spawned supervisor must not. Named so that no user's `worker.py` beside their script can
shadow it in a worker process."""
