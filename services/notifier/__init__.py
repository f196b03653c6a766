"""The notifier: sequenced fan-out of control-plane events to agents, with catch-up."""
