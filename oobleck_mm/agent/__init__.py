"""The node agent: one per node. It registers with the master, heartbeats, starts one
worker process per GPU, relays the master's assignments to them over local pipes and
supervises them; a dead, zombie or stopped worker makes the node lost. Imported as
``oobleck_mm.agent`` (only the CLI imports it: ``.importlinter``).

Modules: ``agent`` (the agent's threads and main loop), ``workers`` (worker
processes: spawn, pipe, psutil supervision, killing whole process trees), ``pipes``
(the workers' pipes, read and closed on one thread), ``reports`` (what it keeps of
its workers' reports, for a restarted master).
"""
