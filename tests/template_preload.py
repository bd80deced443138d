"""What the tests' worker template imports besides the engine's (``runtime.worker_preload``).

The test processes keep one template (``runtime.template``), which ``run_local``'s ranks and the launches
of ``harness.Launch`` fork from (``harness.suite_template``). A launcher's own template also imports its
job's layer code and the balancer's kernels (``worker_preload``, ``TEMPLATE_JOB_ENV``); a template shared by
every test knows no job, so it imports what the tests' models use: transformers' modules of the tiny HF
models (``oobleck_mm.model.tiny_hf``) and the balancer's numba kernels. Without them each worker of an HF
or balanced test paid them before it was ready (a joiner came in too late for an 8-step job). Only imports,
as ``worker_preload``: not with a GPU build of torch (transformers' import asks for CUDA there)."""

from oobleck_mm.runtime.template import gpu_build

if not gpu_build():
    import transformers.models.clip.modeling_clip  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.llava.modeling_llava  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    import transformers.models.siglip.modeling_siglip  # noqa: F401
    import transformers.models.whisper.modeling_whisper  # noqa: F401

    import oobleck_mm.model.huggingface  # noqa: F401
    from oobleck_mm.balance.search import warm_up

    warm_up()
