"""A trace-driven simulation of a training job over hours of node churn (``oobleck-launch simulate``).

Pure: no torch, no grpc. It calls the engine's own planner (templates,
instantiation, reconfiguration, batch split, transfer plan) on every membership
change; only time is simulated. See docs/simulator.md.
"""
