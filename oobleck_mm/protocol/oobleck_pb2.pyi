from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_FAILURE_UNSPECIFIED: _ClassVar[WorkerFailure]
    WORKER_EXITED: _ClassVar[WorkerFailure]
    WORKER_ZOMBIE: _ClassVar[WorkerFailure]
    WORKER_STOPPED: _ClassVar[WorkerFailure]

class StoreOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_OP_UNSPECIFIED: _ClassVar[StoreOp]
    STORE_SET: _ClassVar[StoreOp]
    STORE_GET: _ClassVar[StoreOp]
    STORE_ADD: _ClassVar[StoreOp]
    STORE_COMPARE_SET: _ClassVar[StoreOp]
    STORE_CHECK: _ClassVar[StoreOp]
    STORE_DELETE: _ClassVar[StoreOp]
    STORE_NUM_KEYS: _ClassVar[StoreOp]
WORKER_FAILURE_UNSPECIFIED: WorkerFailure
WORKER_EXITED: WorkerFailure
WORKER_ZOMBIE: WorkerFailure
WORKER_STOPPED: WorkerFailure
STORE_OP_UNSPECIFIED: StoreOp
STORE_SET: StoreOp
STORE_GET: StoreOp
STORE_ADD: StoreOp
STORE_COMPARE_SET: StoreOp
STORE_CHECK: StoreOp
STORE_DELETE: StoreOp
STORE_NUM_KEYS: StoreOp

class Stage(_message.Message):
    __slots__ = ("rank", "layer_start", "layer_end", "slowdown", "shards", "recompute", "context_parallel")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    layer_start: int
    layer_end: int
    slowdown: float
    shards: _containers.RepeatedScalarFieldContainer[int]
    recompute: bool
    context_parallel: bool
    def __init__(self, rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., slowdown: _Optional[float] = ..., shards: _Optional[_Iterable[int]] = ..., recompute: _Optional[bool] = ..., context_parallel: _Optional[bool] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("num_microbatches", "stages", "branches", "merge")
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    num_microbatches: int
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    branches: _containers.RepeatedScalarFieldContainer[int]
    merge: int
    def __init__(self, num_microbatches: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., branches: _Optional[_Iterable[int]] = ..., merge: _Optional[int] = ...) -> None: ...

class ExecutionPlan(_message.Message):
    __slots__ = ("num_layers", "microbatch_size", "pipelines")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    microbatch_size: int
    pipelines: _containers.RepeatedCompositeFieldContainer[Pipeline]
    def __init__(self, num_layers: _Optional[int] = ..., microbatch_size: _Optional[int] = ..., pipelines: _Optional[_Iterable[_Union[Pipeline, _Mapping]]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "store_host", "store_port", "start_step", "steps", "plan", "previous_generation", "previous_plan", "previous_ranks", "resume_dir", "save_final_dir", "checkpoint_interval", "checkpoint_dir", "rank_nodes", "checkpoint_async", "at_boundary", "store_token", "checkpoint_after_first_step", "resume_chosen")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_PLAN_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RANKS_FIELD_NUMBER: _ClassVar[int]
    RESUME_DIR_FIELD_NUMBER: _ClassVar[int]
    SAVE_FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    RANK_NODES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ASYNC_FIELD_NUMBER: _ClassVar[int]
    AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    STORE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AFTER_FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    start_step: int
    steps: int
    plan: ExecutionPlan
    previous_generation: int
    previous_plan: ExecutionPlan
    previous_ranks: _containers.RepeatedScalarFieldContainer[int]
    resume_dir: str
    save_final_dir: str
    checkpoint_interval: int
    checkpoint_dir: str
    rank_nodes: _containers.RepeatedScalarFieldContainer[str]
    checkpoint_async: bool
    at_boundary: bool
    store_token: str
    checkpoint_after_first_step: bool
    resume_chosen: bool
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., start_step: _Optional[int] = ..., steps: _Optional[int] = ..., plan: _Optional[_Union[ExecutionPlan, _Mapping]] = ..., previous_generation: _Optional[int] = ..., previous_plan: _Optional[_Union[ExecutionPlan, _Mapping]] = ..., previous_ranks: _Optional[_Iterable[int]] = ..., resume_dir: _Optional[str] = ..., save_final_dir: _Optional[str] = ..., checkpoint_interval: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., rank_nodes: _Optional[_Iterable[str]] = ..., checkpoint_async: _Optional[bool] = ..., at_boundary: _Optional[bool] = ..., store_token: _Optional[str] = ..., checkpoint_after_first_step: _Optional[bool] = ..., resume_chosen: _Optional[bool] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("dir", "generation", "surviving_ranks", "at_boundary")
    DIR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SURVIVING_RANKS_FIELD_NUMBER: _ClassVar[int]
    AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    dir: str
    generation: int
    surviving_ranks: _containers.RepeatedScalarFieldContainer[int]
    at_boundary: bool
    def __init__(self, dir: _Optional[str] = ..., generation: _Optional[int] = ..., surviving_ranks: _Optional[_Iterable[int]] = ..., at_boundary: _Optional[bool] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason", "at_boundary")
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    reason: str
    at_boundary: bool
    def __init__(self, reason: _Optional[str] = ..., at_boundary: _Optional[bool] = ...) -> None: ...

class MasterLost(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("assignment", "shutdown", "checkpoint", "master_lost")
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MASTER_LOST_FIELD_NUMBER: _ClassVar[int]
    assignment: Assignment
    shutdown: Shutdown
    checkpoint: Checkpoint
    master_lost: MasterLost
    def __init__(self, assignment: _Optional[_Union[Assignment, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., master_lost: _Optional[_Union[MasterLost, _Mapping]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("generation", "step", "rank", "loss", "samples_per_s", "step_time_s", "forward_s", "backward_s", "comm_s", "lr", "grad_norm", "tokens", "peak_memory_bytes", "pipeline_s", "skipped", "loss_scale", "predicted_max_s", "predicted_mean_s", "predicted_contiguous_max_s", "finished_at", "deferred", "emulated_ops", "emulated_late_ops", "emulated_worst_lateness", "emulated_s", "emulated_late_s", "expected_compute_s", "host_cpu_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    COMM_S_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_S_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MAX_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MEAN_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CONTIGUOUS_MAX_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    EMULATED_OPS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_LATE_OPS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_WORST_LATENESS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_S_FIELD_NUMBER: _ClassVar[int]
    EMULATED_LATE_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    HOST_CPU_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    rank: int
    loss: float
    samples_per_s: float
    step_time_s: float
    forward_s: float
    backward_s: float
    comm_s: float
    lr: float
    grad_norm: float
    tokens: int
    peak_memory_bytes: int
    pipeline_s: float
    skipped: bool
    loss_scale: float
    predicted_max_s: float
    predicted_mean_s: float
    predicted_contiguous_max_s: float
    finished_at: float
    deferred: int
    emulated_ops: int
    emulated_late_ops: int
    emulated_worst_lateness: float
    emulated_s: float
    emulated_late_s: float
    expected_compute_s: float
    host_cpu_s: float
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., comm_s: _Optional[float] = ..., lr: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., pipeline_s: _Optional[float] = ..., skipped: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., predicted_max_s: _Optional[float] = ..., predicted_mean_s: _Optional[float] = ..., predicted_contiguous_max_s: _Optional[float] = ..., finished_at: _Optional[float] = ..., deferred: _Optional[int] = ..., emulated_ops: _Optional[int] = ..., emulated_late_ops: _Optional[int] = ..., emulated_worst_lateness: _Optional[float] = ..., emulated_s: _Optional[float] = ..., emulated_late_s: _Optional[float] = ..., expected_compute_s: _Optional[float] = ..., host_cpu_s: _Optional[float] = ...) -> None: ...

class WorkerDone(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class WorkerFailed(_message.Message):
    __slots__ = ("message", "user_error", "bug")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USER_ERROR_FIELD_NUMBER: _ClassVar[int]
    BUG_FIELD_NUMBER: _ClassVar[int]
    message: str
    user_error: bool
    bug: bool
    def __init__(self, message: _Optional[str] = ..., user_error: _Optional[bool] = ..., bug: _Optional[bool] = ...) -> None: ...

class PhaseDone(_message.Message):
    __slots__ = ("generation", "phase", "step", "seconds", "bytes", "message", "transfer_seconds", "formed_ahead", "bad_checkpoint")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORMED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    BAD_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    phase: str
    step: int
    seconds: float
    bytes: int
    message: str
    transfer_seconds: float
    formed_ahead: bool
    bad_checkpoint: str
    def __init__(self, generation: _Optional[int] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., message: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., formed_ahead: _Optional[bool] = ..., bad_checkpoint: _Optional[str] = ...) -> None: ...

class CheckpointDone(_message.Message):
    __slots__ = ("dir", "step", "layers", "generation", "seconds", "snapshot_seconds", "error")
    DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    dir: str
    step: int
    layers: int
    generation: int
    seconds: float
    snapshot_seconds: float
    error: str
    def __init__(self, dir: _Optional[str] = ..., step: _Optional[int] = ..., layers: _Optional[int] = ..., generation: _Optional[int] = ..., seconds: _Optional[float] = ..., snapshot_seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class Stalled(_message.Message):
    __slots__ = ("generation", "what", "waited_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    what: str
    waited_s: float
    def __init__(self, generation: _Optional[int] = ..., what: _Optional[str] = ..., waited_s: _Optional[float] = ...) -> None: ...

class WorkerReady(_message.Message):
    __slots__ = ("startup_s",)
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    startup_s: float
    def __init__(self, startup_s: _Optional[float] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("metrics", "done", "failed", "phase", "checkpoint_done", "stalled", "ready")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DONE_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    metrics: StepMetrics
    done: WorkerDone
    failed: WorkerFailed
    phase: PhaseDone
    checkpoint_done: CheckpointDone
    stalled: Stalled
    ready: WorkerReady
    def __init__(self, metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., done: _Optional[_Union[WorkerDone, _Mapping]] = ..., failed: _Optional[_Union[WorkerFailed, _Mapping]] = ..., phase: _Optional[_Union[PhaseDone, _Mapping]] = ..., checkpoint_done: _Optional[_Union[CheckpointDone, _Mapping]] = ..., stalled: _Optional[_Union[Stalled, _Mapping]] = ..., ready: _Optional[_Union[WorkerReady, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node", "gpus", "memory_bytes", "pid", "adopt_generation")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ADOPT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpus: int
    memory_bytes: int
    pid: int
    adopt_generation: int
    def __init__(self, node: _Optional[str] = ..., gpus: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., adopt_generation: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("node", "session", "gpus", "config_yaml", "resume_command", "adopted")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    RESUME_COMMAND_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    node: str
    session: int
    gpus: int
    config_yaml: str
    resume_command: str
    adopted: bool
    def __init__(self, node: _Optional[str] = ..., session: _Optional[int] = ..., gpus: _Optional[int] = ..., config_yaml: _Optional[str] = ..., resume_command: _Optional[str] = ..., adopted: _Optional[bool] = ...) -> None: ...

class NodeRef(_message.Message):
    __slots__ = ("node", "session")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    session: int
    def __init__(self, node: _Optional[str] = ..., session: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class AgentEvent(_message.Message):
    __slots__ = ("assignment", "shutdown", "checkpoint", "restart", "bench")
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    BENCH_FIELD_NUMBER: _ClassVar[int]
    assignment: WorkerAssignment
    shutdown: Shutdown
    checkpoint: Checkpoint
    restart: RestartWorkers
    bench: Bench
    def __init__(self, assignment: _Optional[_Union[WorkerAssignment, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., restart: _Optional[_Union[RestartWorkers, _Mapping]] = ..., bench: _Optional[_Union[Bench, _Mapping]] = ...) -> None: ...

class Bench(_message.Message):
    __slots__ = ("reason", "seconds")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    seconds: float
    def __init__(self, reason: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class RestartWorkers(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class WorkerAssignment(_message.Message):
    __slots__ = ("local_rank", "assignment")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    assignment: Assignment
    def __init__(self, local_rank: _Optional[int] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ...) -> None: ...

class WorkerReportRequest(_message.Message):
    __slots__ = ("node", "local_rank", "report", "replayed")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    local_rank: int
    report: WorkerReport
    replayed: bool
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ..., local_rank: _Optional[int] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class WorkerFailureRequest(_message.Message):
    __slots__ = ("node", "local_rank", "failure", "message")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    local_rank: int
    failure: WorkerFailure
    message: str
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ..., local_rank: _Optional[int] = ..., failure: _Optional[_Union[WorkerFailure, str]] = ..., message: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    reason: str
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("op", "key", "value", "expected", "amount", "keys", "wait_s", "siblings")
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    op: StoreOp
    key: str
    value: bytes
    expected: bytes
    amount: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    wait_s: float
    siblings: bool
    def __init__(self, op: _Optional[_Union[StoreOp, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., wait_s: _Optional[float] = ..., siblings: _Optional[bool] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("found", "value", "number", "instance", "held", "siblings")
    class SiblingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    number: int
    instance: str
    held: bool
    siblings: _containers.ScalarMap[str, bytes]
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ..., instance: _Optional[str] = ..., held: _Optional[bool] = ..., siblings: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
