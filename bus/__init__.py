"""The shared transport of the control plane: wire format, sockets, services, clients, pub/sub, config, logs.

Nothing outside `bus/` touches frames or socket options.
"""
