"""The agent: one per host. Registers and heartbeats, spawns and stops workers, relays events and requests."""
