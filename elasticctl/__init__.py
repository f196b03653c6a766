"""elasticctl: the operator's command line (run, status, drain, undrain, local, keys)."""
