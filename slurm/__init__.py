"""Slurm: `elasticctl slurm`'s batch script, the driver that runs inside the allocation, and what Slurm's commands
print, parsed (docs/slurm.md)."""
