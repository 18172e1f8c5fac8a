"""The tierkv daemon (``tierkv serve``) and its client (``tierkv.connect``).

    protocol.py      frame format, limits, opcodes (docs/protocol.md)
    messages.py      one dataclass per message, explicit encode/decode
    server.py        the Daemon: lifecycle, signals; owns the parts below
    serving.py       accepting a connection, its read loop, running each request
    handlers.py      what each request does; owns lease_handlers.py, operations.py
    workers.py       the worker threads store calls run in; releases queued for them
    reload.py        SIGHUP: the settings in force, applied live or refused
    remote_keeper.py the remote tier (cluster) joined and kept connected
    leases.py        leases and staging slots owned by connections
    security.py      socket directory and path checks, SO_PEERCRED, pid file
    regions.py       the staging region; cleanup of shm left by dead processes
    metrics.py       Prometheus metrics (own registry, 127.0.0.1 only)
    config.py        DaemonConfig; flags > TOML file > environment; the home's layout
    client.py        Client: the embedded store's API over the socket
    remote_lease.py  RemoteLease and the client's views of the shared pools
"""
