"""The control plane replicated over etcd."""
