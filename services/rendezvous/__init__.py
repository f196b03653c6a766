"""The rendezvous: rounds, their rank assignments, parked joins, and the job's key-value store."""
