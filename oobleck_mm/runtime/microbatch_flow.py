"""How microbatches flow through a stage: packing, the forward and backward of each, and their transfers.

The data-moving half of the 1F1B instruction set (``LoadMicroBatch``, ``RecvActivation``, ``ForwardPass``,
``SendActivation``, ``RecvGrad``, ``BackwardPass``, ``SendGrad``) and Entrain's decoupled microbatches, as a
base of ``oobleck_mm.runtime.engine.StageEngine``, which owns the state these read (its ``__init__``) and
the other half (the gradient sums and the update).
"""

from __future__ import annotations

import time

import torch

from oobleck_mm.balance.assignment import Assignment
from oobleck_mm.data.packing import PackedBatch
from oobleck_mm.model.layers import microbatch_loss
from oobleck_mm.planning.layout import piece_samples
from oobleck_mm.runtime.mixed import overflow_injected
from oobleck_mm.runtime.context_parallel import context_share
from oobleck_mm.runtime.p2p import recv_tensors_timed, send_tensors


class MicrobatchFlow:
    def _batch(self, mb: int, piece: int = 0) -> PackedBatch:
        if self._decoupled:  # packed per group (see _forward_decoupled); only the first/last stage's load
            return self._pack(mb, self._llm_microbatches[mb] if self.side == "llm" else self._microbatches[mb])
        if (mb, piece) not in self._batches:
            t0 = time.perf_counter()
            ids = self._piece_ids(mb, piece)
            # Built on the host, then copied to the stage's device (pinned, asynchronous on a GPU).
            batch = self.data.microbatch(ids, media=self.reads_media).to(self.device, non_blocking=True)
            if self.stage.context_parallel:  # this lane's share of the sequence's tokens
                batch = context_share(batch, piece, self.stage.width, self.sync.stage_group)
            self._batches[(mb, piece)] = batch
            spent = time.perf_counter() - t0
            self._pack_s[mb] = self._pack_s.get(mb, 0.0) + spent
            self._result.pack_s += spent
        return self._batches[(mb, piece)]

    def _piece_ids(self, mb: int, piece: int) -> tuple[int, ...]:
        """The samples piece ``piece`` of microbatch ``mb`` runs. A piece left without samples (the balancer
        made the microbatch smaller than the pipeline's pieces) runs the microbatch's first sample with its
        loss weighted 0 (``_filler``): the ranks of a stage of several GPUs must all run FSDP2's collectives.
        A context-parallel pipeline's pieces share every sample of the microbatch (they split its tokens)."""
        if self.stage.context_parallel:
            return tuple(self._microbatches[mb])
        ids = piece_samples(self._microbatches[mb], self.pipeline.pieces, piece)
        return ids if ids else tuple(self._microbatches[mb][:1])

    def _filler(self, mb: int, piece: int) -> bool:
        """Whether piece ``piece`` of microbatch ``mb`` has no samples of its own (``_piece_ids``)."""
        if self.stage.context_parallel:
            return False
        return not piece_samples(self._microbatches[mb], self.pipeline.pieces, piece)

    # ------------------------------------------------------------------ decoupled microbatches (deferral)
    def _decouple(self, assignment: Assignment) -> None:
        """Entrain's decoupled microbatches (``balance/deferral.py``). Slot k's encoder microbatch ``E_k`` is
        ``assignment.pipelines[p][k]``; its LLM microbatch is ``L_k = kept_k + D_{k-1}`` with ``kept_k = E_k -
        D_k``. Stages before the LLM's first layer run ``E_k`` as two groups, ``kept_k`` and ``D_k`` (each its
        own packed batch and autograd graph, so their backwards run apart: Entrain's split backward); the stage
        holding ``llm.embed`` runs its encoder layers on those groups, keeps ``D_k``'s outputs for the next
        slot, and runs its LLM layers on ``L_k``; later stages run ``L_k``. Backward of slot k reaches the
        groups whose LLM work ran in slot k: ``kept_k`` and ``D_{k-1}``. Every transfer keeps DeepSpeed's 1F1B
        instruction order; only what a message holds changes, and every rank derives that from the
        assignment. Samples are independent (block-diagonal attention, per-sample loss over the global token
        count), so the update is the undecoupled one up to summation order."""
        p = self.pipeline_index
        self._deferred = assignment.deferred[p] if assignment.deferred else ()
        self._decoupled = self.seam is not None and any(self._deferred)
        if not self._decoupled:
            self._llm_microbatches = self._microbatches
            return
        if self.pipeline.pieces > 1:
            raise ValueError(
                f"pipeline {p} has a stage of {self.pipeline.pieces} GPUs; Entrain's deferral does not run "
                f"on such pipelines yet (balance.deferral: false)"
            )
        if self._deferred[-1]:
            raise ValueError(
                f"the last microbatch of pipeline {p} defers samples {self._deferred[-1]}: nothing runs after it"
            )
        self._llm_microbatches = assignment.llm_microbatches(p)
        # kept_k: L_k without what it received from slot k - 1 (llm_microbatches puts those last)
        self._kept = [
            lm[: len(lm) - len(self._deferred[k - 1])] if k else lm for k, lm in enumerate(self._llm_microbatches)
        ]
        self._group_in: dict[tuple[int, str], tuple] = {}
        self._group_out: dict[tuple[int, str], tuple] = {}
        self._group_sizes: dict[tuple[int, str], list[int]] = {}  # merge stage: per group, each branch's tensors
        self._held: dict[int, tuple] = {}
        self._backward_groups: dict[int, list[tuple[int, str]]] = {}

    def _pack(self, slot: int, ids: tuple[int, ...]) -> PackedBatch:
        key = tuple(ids)
        if key not in self._batches:
            t0 = time.perf_counter()
            self._batches[key] = self.data.microbatch(key, media=self.reads_media).to(self.device, non_blocking=True)
            spent = time.perf_counter() - t0
            self._pack_s[slot] = self._pack_s.get(slot, 0.0) + spent
            self._result.pack_s += spent
        return self._batches[key]

    def _forward_groups(self, k: int) -> list[tuple[int, str]]:
        """The encoder groups slot k's forward runs: its kept samples, then its deferred ones."""
        return [(k, "kept")] + ([(k, "deferred")] if self._deferred[k] else [])

    def _backward_groups_of(self, k: int) -> list[tuple[int, str]]:
        """The encoder groups slot k's backward reaches: its kept samples, then the previous slot's deferred."""
        return [(k, "kept")] + ([(k - 1, "deferred")] if k > 0 and self._deferred[k - 1] else [])

    def _group_ids(self, group: tuple[int, str]) -> tuple[int, ...]:
        k, part = group
        return self._kept[k] if part == "kept" else tuple(self._deferred[k])

    def _run_layers(self, layers, acts, batch):
        # The plan decides per stage (StageSpec.recompute); an emulated job's compute copy never recomputes
        # (config.emulation.compute_training: its emulated time still charges the stage's recomputation).
        ckpt = self.stage.recompute and self.job.training.activation_checkpointing is not False and self.needs_backward
        shard = batch.context
        for i in layers:
            # A context-parallel lane runs the encoders and the token embedding on the whole microbatch, then
            # its own tokens of the sequence (runtime.context_parallel).
            on = shard.whole if shard is not None and self.seam is not None and i <= self.seam else batch
            if ckpt:
                acts = torch.utils.checkpoint.checkpoint(self.compute[i], acts, on, use_reentrant=False)
                self._result.recomputed += 1
            else:
                acts = self.compute[i](acts, on)
            if shard is not None and i == self.seam:
                acts = shard.narrow(acts)
        return acts

    def _forward_decoupled(self, ins, mb: int) -> None:
        groups = self._forward_groups(mb)
        received = self._inputs.pop(ins.buffer_id, {}).get(0, ()) if self.prev_rank is not None else ()
        inputs = self._split_groups(received, groups, self._branch_sizes.pop(ins.buffer_id, {}).get(0))
        encoder_layers = [i for i in self.stage.layers if i < self.seam]
        with torch.set_grad_enabled(self.needs_backward):
            outs = {}
            for group, acts in zip(groups, inputs, strict=True):
                self._group_in[group] = acts
                if encoder_layers:  # (a seam stage starting at llm.embed packs only L_k, below)
                    acts = self._run_layers(encoder_layers, acts, self._pack(mb, self._group_ids(group)))
                outs[group] = acts
            if self.side == "encoder":
                self._group_out.update(outs)
                self._outputs[ins.buffer_id] = {0: tuple(t for g in groups for t in outs[g])}
                return
            # The seam: L_k's encoder outputs are kept_k's, then D_{k-1}'s (held since the last slot).
            if (mb, "deferred") in outs:
                self._held[mb] = outs[(mb, "deferred")]
            acts = outs[(mb, "kept")]
            if mb - 1 in self._held:
                acts = tuple(torch.cat([a, b]) for a, b in zip(acts, self._held.pop(mb - 1), strict=True))
            batch = self._pack(mb, self._llm_microbatches[mb])
            acts = self._run_layers([i for i in self.stage.layers if i >= self.seam], acts, batch)
            self._outputs[ins.buffer_id] = {0: self._maybe_loss(acts, batch)}

    def _split_groups(self, received, groups, branch_sizes=None) -> list[tuple]:
        """Per group of ``groups``, its tensors of ``received``: a sender sends its groups' tensors one group
        after another; the merge stage of a branched pipeline received every branch's (``branch_sizes``: how
        many tensors each sent), in branch order, and a group's input is each branch's part of it, in branch
        order (``_group_sizes`` keeps each branch's count, to send each its gradients back)."""
        parts, offset = [], 0
        for size in branch_sizes or [len(received)]:
            parts.append(received[offset : offset + size])
            offset += size
        per = [len(part) // len(groups) for part in parts]
        out = []
        for n, group in enumerate(groups):
            out.append(tuple(t for part, k in zip(parts, per) for t in part[n * k : (n + 1) * k]))
            if branch_sizes:
                self._group_sizes[group] = per
        return out

    def _maybe_loss(self, acts, batch, weight: float = 1.0):
        """``weight`` 0: a filler piece (``_piece_ids``), whose loss and gradients are exact zeros."""
        if self.next_rank is not None:
            return acts
        loss = microbatch_loss(acts[0], batch, self._loss_tokens) * weight
        self._loss += loss.detach().double()  # stays on the device: no sync per microbatch
        return (loss * self.scaler.scale,) if self.scaler is not None else (loss,)

    # ------------------------------------------------------------------ instructions
    def _load_microbatch(self, ins) -> None:
        # Only the first and last stages get this instruction; every stage packs lazily in _batch.
        if not self._decoupled:  # (decoupled: packed per group, in _forward_decoupled)
            for piece in self.pieces:
                self._batch(self._next_load, piece)
        self._next_load += 1

    def _recv_activation(self, ins) -> None:
        t0 = time.perf_counter()
        received = {}
        if self.branch_ranks:  # the merge stage: every branch's outputs of a piece, in branch order, are its input
            sizes, merged = {}, []
            for piece, srcs in self.branch_ranks.items():
                parts = [self._receive(src) for src in srcs]
                sizes[piece] = [len(part) for part in parts]
                merged.append((piece, [t for part in parts for t in part]))
            self._branch_sizes[ins.buffer_id] = sizes
            sources = merged
        else:
            sources = ((piece, self._receive(src)) for piece, src in self.prev_ranks.items())
        for piece, acts in sources:  # every rank in piece order: the senders' order too
            if self.needs_input_grad:
                acts = tuple(a.requires_grad_() if a.is_floating_point() else a for a in acts)
            received[piece] = tuple(acts)
        self._inputs[ins.buffer_id] = received
        self._result.comm_s += time.perf_counter() - t0

    def _forward(self, ins) -> None:
        mark = self.clock.start()
        began = time.monotonic()
        mb = self._next_forward
        self._next_forward += 1
        self._buffer_mb[ins.buffer_id] = mb
        if self._decoupled and self.side != "llm":
            self._forward_decoupled(ins, mb)
            self._intervals.append([self._forward_time(mark, began, mb), None])
            return
        received = self._inputs.get(ins.buffer_id, {})
        outputs = {}
        for piece in self.pieces:  # a stage's ranks run as many pieces each: their FSDP2 collectives pair up
            batch = self._batch(mb, piece)
            with torch.set_grad_enabled(self.needs_backward):
                acts = self._run_layers(self.stage.layers, received.get(piece, ()), batch)
                outputs[piece] = self._maybe_loss(acts, batch, 0.0 if self._filler(mb, piece) else 1.0)
        self._outputs[ins.buffer_id] = outputs
        self._intervals.append([self._forward_time(mark, began, mb), None])
        if self.prefetch and not self._decoupled and mb + 1 < len(self._microbatches):
            for piece in self.pieces:
                self._batch(mb + 1, piece)

    def _forward_time(self, mark, began: float, mb: int):
        """The forward's interval for ``self.clock.seconds``: on an emulated device, its device seconds."""
        if self.timer is None:
            return self.clock.stop(mark)
        return self.timer.forward(began, self._microbatches[mb], self._llm_microbatches[mb])

    def _send_activation(self, ins) -> None:
        t0 = time.perf_counter()
        arrival = 0.0
        if self.timer is not None:
            mb, last = self._buffer_mb[ins.buffer_id], self.stage.layer_end - 1
            ids = self._microbatches[mb] if self.seam is not None and last < self.seam else self._llm_microbatches[mb]
            arrival = self.timer.arrival(last, ids)
        for piece, acts in self._outputs[ins.buffer_id].items():
            self._result.bytes_sent += send_tensors(acts, self.next_ranks[piece], self.device, self.waiter, arrival)
        self._result.comm_s += time.perf_counter() - t0

    def _receive(self, src: int) -> tuple:
        """A message from rank ``src``; on an emulated device, once its emulated arrival time has come."""
        tensors, arrival = recv_tensors_timed(src, self.device, self.waiter)
        if self.timer is not None:
            self.timer.received(arrival)
        return tensors

    def _backward_group_inputs(self, groups) -> tuple[dict, dict | None]:
        """The inputs of the encoder groups a backward reached, in the order their senders wait for the
        gradients: one group after another (``_backward_groups_of``); at a branched pipeline's merge stage,
        per branch, its part of each group (and each branch's count of them)."""
        tensors = [self._group_in.pop(g) for g in groups]
        if not self.branch_ranks:
            return {0: tuple(t for group in tensors for t in group)}, None
        sizes = [self._group_sizes.pop(g) for g in groups]  # per group, per branch
        ordered, counts = [], []
        for b in range(len(sizes[0])):
            before = len(ordered)
            for group, per in zip(tensors, sizes, strict=True):
                start = sum(per[:b])
                ordered.extend(group[start : start + per[b]])
            counts.append(len(ordered) - before)
        return {0: tuple(ordered)}, {0: counts}

    def _recv_grad(self, ins) -> None:
        if not self.next_needs_grad:
            return
        t0 = time.perf_counter()
        self._grads[ins.buffer_id] = {piece: self._receive(src) for piece, src in self.next_ranks.items()}
        self._result.comm_s += time.perf_counter() - t0

    def _backward(self, ins) -> None:
        mark = self.clock.start()
        began = time.monotonic()
        outputs = self._outputs.pop(ins.buffer_id)
        grads = self._grads.pop(ins.buffer_id, None)
        if self._decoupled and self.side != "llm":
            # The groups whose LLM work ran in this slot (their input gradients go back in _send_grad); an
            # encoder stage's outputs are theirs, the gradients arrive in _backward_groups_of's order.
            groups = self._backward_groups_of(self._buffer_mb[ins.buffer_id])
            self._backward_groups[ins.buffer_id] = groups
            if self.side == "encoder":
                outputs = {0: [t for group in groups for t in self._group_out.pop(group)]}
        if self.needs_backward:
            calls = []  # (outputs, their gradients) per piece, in the forward's order
            for piece, piece_outputs in outputs.items():
                if self.next_rank is None:
                    calls.append(([piece_outputs[0]], None))
                elif grads is not None:
                    pairs = [(o, g) for o, g in zip(piece_outputs, grads[piece], strict=True) if o.requires_grad]
                    if pairs:
                        calls.append(([o for o, _ in pairs], [g for _, g in pairs]))
            last = self._backwards == len(self._microbatches) - 1
            for n, (tensors, tensor_grads) in enumerate(calls):
                if last and n == len(calls) - 1 and self.overlap and not overflow_injected(self._step, self.rank):
                    # After this call no gradient changes: each bucket's sum may start as its layers finish.
                    # (An injected overflow poisons the gradients after the backward: summed after it.)
                    self.sync.arm(self.layers, self.compute)
                torch.autograd.backward(tensors, tensor_grads)
        self._backwards += 1
        mb = self._buffer_mb.pop(ins.buffer_id)
        self._grad_mb[ins.buffer_id] = mb
        if not self._decoupled:  # (decoupled batches are keyed by samples, not slots: kept for the step)
            for piece in self.pieces:
                self._batches.pop((mb, piece), None)
        if self.timer is None:
            self._intervals[mb][1] = self.clock.stop(mark)
        else:
            self._intervals[mb][1] = (
                self.timer.backward(began, self._llm_microbatches[mb]) if self.needs_backward else 0.0
            )

    def _send_grad(self, ins) -> None:
        branch_sizes = self._branch_sizes.pop(ins.buffer_id, None)
        if self._decoupled and self.side != "llm":
            groups = self._backward_groups.pop(ins.buffer_id)
            inputs, branch_sizes = self._backward_group_inputs(groups)
        else:
            inputs = self._inputs.pop(ins.buffer_id)
        mb = self._grad_mb.pop(ins.buffer_id, None)
        if not self.needs_input_grad:
            return
        t0 = time.perf_counter()
        arrival = 0.0
        if self.timer is not None and mb is not None:  # the gradient of the previous stage's output, over L_k
            arrival = self.timer.arrival(self.stage.layer_start - 1, self._llm_microbatches[mb])
        for piece, piece_inputs in inputs.items():
            grads = tuple(a.grad if a.grad is not None else torch.zeros_like(a) for a in piece_inputs)
            if self.branch_ranks:  # each branch its outputs' gradients, if it trains
                offset = 0
                for src, size, needed in zip(
                    self.branch_ranks[piece], branch_sizes[piece], self.branch_needs_grad, strict=True
                ):
                    if needed:
                        part = grads[offset : offset + size]
                        self._result.bytes_sent += send_tensors(part, src, self.device, self.waiter, arrival)
                    offset += size
                continue
            self._result.bytes_sent += send_tensors(grads, self.prev_ranks[piece], self.device, self.waiter, arrival)
        self._result.comm_s += time.perf_counter() - t0
