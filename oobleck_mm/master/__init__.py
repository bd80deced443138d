"""The master daemon: one per job. It registers agents, detects failures, plans, assigns
workers their ranks and layers, hosts the rendezvous store, completes checkpoints and prints
progress. Imported as ``oobleck_mm.master`` (only the CLI imports it: ``.importlinter``).

The decisions, pure (plain data in and out, no threads, gRPC or files):

- ``machine``: ``step(state, event, now) -> Transition``, the one entry point; its parts
  ``generations`` (what to plan, applying plans), ``adoption`` (a restarted master re-adopting
  the journal's generation), ``stopping`` (stopping with nothing lost, periodic checkpoints),
  ``slow_nodes`` (straggler verdicts from completed steps, and what follows), ``benching`` (a
  straggler planned out for a while); the detection cadence is the machine's too (``Tick``);
- ``state`` (the whole state), ``inputs`` (every event), ``effects`` (every side effect asked
  for), ``context`` (one step in progress);
- ``detector`` (failure detection), ``recovery`` (which generation to plan from),
  ``policies`` (live or restart recovery, answering in values), ``stragglers`` (slow nodes),
  ``registry`` (who is registered), ``assignments`` (what each worker is sent).

The shell that feeds them events and carries out their effects:

- ``coordinator`` (threads, locks, outboxes), ``service`` (the gRPC face, token check),
  ``server`` (process wiring, control loop), ``store`` (the rendezvous store), ``planning``
  (the planner in a helper process), ``progress`` (reports into completed steps for the machine to
  judge, progress lines and events),
  ``checkpointing`` (meta.json, pruning, ``--resume`` checks), ``disk`` (ordered writes),
  ``journal`` (what a restarted master re-adopts from), ``metrics`` (metrics.csv,
  TensorBoard), ``stalls`` (the control loop's stack dumps), ``local`` (``oobleck-launch
  local``: a master and N agents on this machine).
"""
