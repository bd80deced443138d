"""The master daemon: one per job. It registers agents, detects failures, plans, assigns
workers their ranks and layers, hosts the rendezvous store and prints progress.

Modules: ``detector`` (pure failure detection), ``coordinator`` (the job's state
machine, no gRPC), ``service`` (the gRPC face of the coordinator, token check),
``server`` (process wiring: gRPC server, TCPStore, control loop, run dir).
"""
