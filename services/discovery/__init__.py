"""Discovery: which hosts exist, their slots, their order, drain and blacklist."""
