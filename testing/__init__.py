"""What tests and benchmarks share: the whole system started as processes on loopback (`harness`), and N ranks of a
real gloo process group without the control plane (`ranks`)."""
