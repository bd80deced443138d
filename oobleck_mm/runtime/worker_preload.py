"""What an agent's worker template imports before it forks workers (``oobleck_mm/agent/workers.py``).

Only imports: no tensor is made, no thread started, the CUDA driver never
initialised, so a fork of the template is as sound as a fresh interpreter
(``tests/integration/test_worker_template.py`` checks the template is
single-threaded and CUDA untouched, on a GPU too). The worker's own warm-up (its
first optimizer) runs in each worker.

With a GPU build of torch, DeepSpeed stays out: importing any part of it runs its
accelerator probe, which initialises the CUDA driver (seen on an H200: a
``cuda0000...`` driver thread appeared at ``import deepspeed.accelerator``), and
a driver initialised before a fork is not usable in the child. There the
workers import DeepSpeed's schedules and the engine (about 0.35 s) themselves.
"""

import os
import signal

# A scheduler's SIGTERM to the node's processes is its agent's notice; the template outlives it like the
# workers (``oobleck_mm.agent.workers.worker_entry``), and ends with its agent. Before forkserver's own handlers:
# its forks inherit this.
signal.signal(signal.SIGTERM, signal.SIG_IGN)

import torch  # noqa: E402
import torch._dynamo  # noqa: F401 - torch's first optimizer imports it: 1.5-2 s on a 2-core machine

import oobleck_mm.config  # noqa: F401
import oobleck_mm.data.loader  # noqa: F401
import oobleck_mm.model.layers  # noqa: F401 - the built-in model and the HF adapters (transformers loads lazily)
import oobleck_mm.protocol.pipe  # noqa: F401
import oobleck_mm.runtime.balancing  # noqa: F401 - also warm_balancer, below
import oobleck_mm.runtime.group  # noqa: F401
import oobleck_mm.runtime.store  # noqa: F401 - the rendezvous store's client and gRPC's stubs
from oobleck_mm.runtime.template import TEMPLATE_JOB_ENV, gpu_build  # noqa: E402


# Decided by how torch was built, without asking whether a GPU is there: even NVML's answer
# (``torch.cuda.is_available`` under PYTORCH_NVML_BASED_CUDA_CHECK) starts a driver thread
# ("cuda00001800007", seen on an H200), and a template must fork from one thread. A CUDA build on a
# machine without a GPU only makes its workers import DeepSpeed themselves.
if not gpu_build():
    import oobleck_mm.runtime.agent_worker  # noqa: F401 - DeepSpeed's schedules, the engine


# A template that knows its job (``oobleck-launch local``'s) imports its layers' code too: a worker forked
# from it then skips ``import_layer_code``'s imports (0.7 s for the tiny HF LLaVA). Not with a GPU build:
# transformers' import asks torch whether CUDA is there, which starts a driver thread (see above).
if (job_file := os.environ.get(TEMPLATE_JOB_ENV)) and not gpu_build():
    try:
        from oobleck_mm.config import load_config
        from oobleck_mm.model.layers import import_layer_code

        job = load_config(job_file)
        import_layer_code(job)
        # The balancer's numba kernels, which each worker would load before it is ready; loading starts
        # no thread.
        oobleck_mm.runtime.balancing.warm_balancer(job)
    except Exception:  # noqa: BLE001 - only a warm-up: each worker does it again, and says what is wrong
        pass
