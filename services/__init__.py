"""The four control-plane services. Each runs as `python -m services.<name>`; they share `bus/` only."""
