"""The registry: the job, worker states per round, and the driver's decisions."""
