"""The master's recovery decisions (``oobleck_mm.master.recovery``), on generations and holdings built by hand."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.master.recovery import (
    GenerationView,
    Holdings,
    Request,
    StateLost,
    choose_base,
    committed,
    orphan_layers,
    plan_request,
    previous_ranks,
)
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout


def view(number: int, layout: ExecutionPlan, nodes: list[str]) -> GenerationView:
    """One GPU per node; node i runs rank i."""
    return GenerationView(number, layout, {(n, 0): r for r, n in enumerate(nodes)})


# gen 1: pipelines [a b] and [c d], layers 0-4 | 5-9 each
GEN1 = view(1, ExecutionPlan.even(10, [2, 2], [4, 4], 2), ["a", "b", "c", "d"])
# gen 2 after losing d: [a b] unchanged, c alone holds every layer (needs 0-4 copied)
GEN2 = view(
    2,
    ExecutionPlan(
        (PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5), PipelineLayout((StageLayout(2, 0, 10),), 3)),
        10,
        2,
    ),
    ["a", "b", "c"],
)
GENS = {1: GEN1, 2: GEN2}


def holds(**by_node: tuple[int, int]) -> dict:
    """node=(current, committed)."""
    return {(n, 0): Holdings(current=c, committed=k) for n, (c, k) in by_node.items()}


def test_holdings_follow_the_workers_rules():
    h = Holdings().completed_step(1)
    assert h.held() == {1}
    h = h.adopted(2)  # copied into 2, no step yet: 1 is kept
    assert h.held() == {1, 2} and h.committed == 1
    assert h.completed_step(2).held() == {2}  # a step in 2 drops 1
    assert h.completed_step(2).completed_step(1).held() == {2}  # a late report of 1 changes nothing


def test_everyone_holds_the_current_generation_it_is_the_base():
    base, why = choose_base(GENS, holds(a=(1, 1), b=(1, 1), c=(1, 1)), live=["a", "b", "c"])
    assert (base.generation, base.holding_nodes, base.stale_nodes) == (1, ("a", "b", "c"), ())
    assert "generation 1" in why


def test_failure_during_the_copy_plans_from_the_generation_the_survivors_came_from():
    # gen 2 was being set up: a finished its copy (holds 1 and 2), b did not (holds 1); now c is lost too.
    h = holds(a=(2, 1), b=(1, 1))
    base, why = choose_base(GENS, h, live=["a", "b"])
    # gen 2 would need c (the only holder of layers 5-9 beyond b... b does not hold 2): rejected
    assert base.generation == 1 and base.holding_nodes == ("a", "b")
    request, _ = plan_request(GEN2, GENS, h, live=["a", "b"])
    assert request == Request(base=1, plan_from=1, lost=("c", "d"), joined=(), live=("a", "b"), failure=True)


def test_the_newest_generation_wins_a_tie_and_the_most_survivors_win_otherwise():
    h = holds(a=(2, 1), b=(2, 1), c=(2, 1))  # every copy of gen 2 finished, no step yet
    base, _ = choose_base(GENS, h, live=["a", "b", "c"])
    assert base.generation == 2
    # gen 3 = c alone (one stage) held only by c; gen 2 held by a, b and c: keep three nodes' states
    gen3 = view(3, ExecutionPlan.even(10, [1], [8], 2), ["c"])
    h[("c", 0)] = Holdings(current=3, committed=2)
    base, _ = choose_base({**GENS, 3: gen3}, h, live=["a", "b", "c"])
    assert base.generation == 2 and base.holding_nodes == ("a", "b", "c")


def test_a_node_that_does_not_hold_the_base_is_stale_and_starts_empty():
    # c joined in gen 2 (it was not in gen 1 here) and its copy failed; a and b hold 2 and cover it.
    gen2 = view(2, GEN2.layout, ["a", "b", "c"])
    gen1 = view(1, ExecutionPlan.even(10, [1, 1], [4, 4], 2), ["a", "b"])
    h = {("a", 0): Holdings(2, 1), ("b", 0): Holdings(2, 1)}
    base, why = choose_base({1: gen1, 2: gen2}, h, live=["a", "b", "c"])
    assert base.generation == 2 and base.stale_nodes == ("c",) and "c start empty" in why
    request, _ = plan_request(gen2, {1: gen1, 2: gen2}, h, live=["a", "b", "c"])
    assert request is None  # nobody is gone and gen 2 has not completed a step: nothing to do yet
    request, _ = plan_request(gen2, {1: gen1, 2: gen2}, h, live=["a", "b"])  # now c is lost
    assert request == Request(base=2, plan_from=2, lost=("c",), joined=(), live=("a", "b"), failure=True)
    # b lost instead: a alone holds only layers 0-4 of gen 2, but all of gen 1 (one-stage pipeline)
    request, _ = plan_request(gen2, {1: gen1, 2: gen2}, h, live=["a", "c"])
    assert request == Request(base=1, plan_from=1, lost=("b",), joined=("c",), live=("a", "c"), failure=True)


def test_the_model_state_is_gone_when_no_generation_covers_every_layer():
    h = holds(a=(1, 1))  # b, c and d lost: nobody holds layers 5-9
    base, why = choose_base(GENS, h, live=["a"])
    assert base is None and "layers 5-9" in why
    request, _ = plan_request(GEN1, GENS, h, live=["a"])
    assert isinstance(request, StateLost)


def test_nobody_trained_yet_means_a_fresh_start():
    base, _ = choose_base(GENS, {}, live=["a", "b"])
    assert base.generation == 0
    request, _ = plan_request(GEN1, GENS, {}, live=["a", "b", "e"])  # c and d lost, e joined
    assert request == Request(
        base=0, plan_from=1, lost=("c", "d"), joined=("e",), live=("a", "b", "e"), failure=True
    )  # the layout is still planned from generation 1's


def test_joins_wait_for_a_committed_generation_then_join_the_base():
    live = ["a", "b", "c", "d", "e"]
    h = holds(a=(1, 0), b=(1, 0), c=(1, 0), d=(1, 0))  # set up, no step completed yet
    assert plan_request(GEN1, GENS, h, live)[0] is None
    assert not committed(GEN1, h)
    h = holds(a=(1, 1), b=(1, 1), c=(1, 1), d=(1, 1))
    assert committed(GEN1, h)
    request, _ = plan_request(GEN1, GENS, h, live)
    assert request == Request(base=1, plan_from=1, lost=(), joined=("e",), live=tuple(live), failure=False)
    assert plan_request(GEN1, GENS, h, ["a", "b", "c", "d"])[0] is None  # nothing changed


def test_an_abandoned_generation_is_planned_again_with_the_same_nodes_or_with_a_waiting_joiner():
    nodes = ["a", "b", "c", "d"]
    h = holds(a=(1, 1), b=(1, 1), c=(1, 1), d=(1, 1))
    request, why = plan_request(GEN1, GENS, h, nodes, abandoned=True)
    assert request == Request(base=1, plan_from=1, lost=(), joined=(), live=tuple(nodes), failure=True)
    assert request.reform and "re-form" in why
    # Abandoned before its first step: the joiner that was waiting for a committed generation comes along.
    h = holds(a=(1, 0), b=(1, 0), c=(1, 0), d=(1, 0))
    request, _ = plan_request(GEN1, GENS, h, [*nodes, "e"], abandoned=True)
    assert request.joined == ("e",) and not request.reform
    # Generation 2 (after d's loss) abandoned during its copy: the survivors re-form from generation 1.
    h = holds(a=(2, 1), b=(1, 1), c=(1, 1))
    request, _ = plan_request(GEN2, GENS, h, ["a", "b", "c"], abandoned=True)
    assert (request.base, request.lost, request.joined) == (1, ("d",), ())
    assert not request.reform  # a plan from generation 1 without d: the planner's work


def test_previous_ranks_name_each_survivors_old_rank_and_minus_one_for_the_rest():
    new = {("c", 0): 0, ("a", 0): 1, ("e", 0): 2, ("b", 0): 3}
    assert previous_ranks(new, GEN1, holding_nodes=["a", "b", "c"]) == [2, 0, -1, 1]
    assert previous_ranks(new, GEN1, holding_nodes=["a", "b"]) == [-1, 0, -1, 1]  # c is stale
    assert previous_ranks(new, None, holding_nodes=[]) == [-1, -1, -1, -1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=4, max_size=4),
    st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_a_chosen_base_is_held_by_its_survivors_and_covers_every_layer(pairs, alive):
    nodes = ["a", "b", "c", "d"]
    gen2 = view(2, ExecutionPlan.even(10, [1, 3], [4, 4], 2), nodes)
    gens = {1: GEN1, 2: gen2}
    h = {(n, 0): Holdings(current=max(c, k), committed=k) for n, (c, k) in zip(nodes, pairs)}
    live = [n for n, up in zip(nodes, alive) if up]
    base, _ = choose_base(gens, h, live)
    if base is None or base.generation == 0:
        return
    gen = gens[base.generation]
    assert set(base.holding_nodes) <= set(live)
    assert all(base.generation in h[(n, 0)].held() for n in base.holding_nodes)
    alive_ranks = [gen.ranks[(n, 0)] for n in base.holding_nodes]
    assert orphan_layers(gen.layout, alive_ranks) == []
    # and no other usable generation keeps more nodes' states
    for other in {1, 2} - {base.generation}:
        holders = [n for n in live if all(other in h[g].held() for g in gens[other].gpus_of(n))]
        usable = not orphan_layers(gens[other].layout, [gens[other].ranks[(n, 0)] for n in holders])
        assert (
            not usable
            or len(holders) < len(base.holding_nodes)
            or (len(holders) == len(base.holding_nodes) and other < base.generation)
        )


def test_a_loss_plans_the_survivors_alone_when_they_keep_f_plus_one_replicas_and_the_joiner_follows():
    """A joiner in a recovery's plan builds the layers it receives while every survivor waits at the
    rendezvous; when the survivors keep the threshold without it, it joins one generation later."""
    h = holds(a=(1, 1), b=(1, 1), c=(1, 1), d=(1, 1))
    request, why = plan_request(GEN1, GENS, h, ["a", "b", "c", "e"], keeps_replicas_from=2)  # d lost, e ready
    assert request == Request(base=1, plan_from=1, lost=("d",), joined=(), live=("a", "b", "c"), failure=True)
    assert "e join once" in why and "3 survivors" in why
    # Three survivors cannot keep f + 1 replicas of (f + 1) * n0 = 4: the joiner is needed now.
    request, _ = plan_request(GEN1, GENS, h, ["a", "b", "c", "e"], keeps_replicas_from=4)
    assert request.joined == ("e",) and request.live == ("a", "b", "c", "e")
    # Not known (a restarted master's journaled generation): as before, the joiner comes along.
    assert plan_request(GEN1, GENS, h, ["a", "b", "c", "e"])[0].joined == ("e",)
    # An abandoned iteration with every node alive: the same nodes re-form, the joiner waits too.
    request, _ = plan_request(GEN1, GENS, h, ["a", "b", "c", "d", "e"], abandoned=True, keeps_replicas_from=4)
    assert request.reform and request.live == ("a", "b", "c", "d")
    # Once the recovery's generation (a, b, c) completed a step, e joins it.
    gen2 = view(2, ExecutionPlan.even(10, [1, 2], [4, 4], 2), ["a", "b", "c"])
    h = holds(a=(2, 2), b=(2, 2), c=(2, 2))
    request, _ = plan_request(gen2, {**GENS, 2: gen2}, h, ["a", "b", "c", "e"], keeps_replicas_from=2)
    assert request == Request(base=2, plan_from=2, lost=(), joined=("e",), live=("a", "b", "c", "e"), failure=False)


def test_a_plan_from_the_generation_before_a_join_the_workers_switched_to_meanwhile_is_planned_again_from_the_join():
    """The master planned generation 3 from 1 for d's notice (gen 2, e's join, had just gone out: no report of
    it yet), and meanwhile every worker switched to 2 and completed a step there, dropping 1 (seen under
    churn, the master held up by its journal's fsync). The workers abandon 3 (``WorkerLoop.adopt``: a
    ``PeerFailure``, no longer a crash that lost six nodes); their reports of 2 came first, so the
    master plans from 2, e included, and never from 1 again."""
    gen2 = view(2, ExecutionPlan.even(10, [2, 3], [4, 4], 2), ["a", "b", "c", "d", "e"])  # e joins gen 1
    gen3 = view(3, ExecutionPlan.even(10, [2, 2], [4, 4], 2), ["a", "b", "c", "e"])  # planned from 1 (a stand-in)
    gens = {1: GEN1, 2: gen2, 3: gen3}
    h = holds(a=(2, 2), b=(2, 2), c=(2, 2), e=(2, 2))  # a step of 2 completed: 1 is gone
    request, why = plan_request(gen3, gens, h, ["a", "b", "c", "e"], abandoned=True, keeps_replicas_from=2)
    assert request is not None and request.base == 2 and request.plan_from == 2, why
    assert request.live == ("a", "b", "c", "e") and request.lost == ("d",)
    # As it happens: 3 left e out (a joiner planned but not switched to waits out a loss), yet e holds 2 like
    # the others: a survivor of the base, not a joiner to defer (deferred, it joined again in a generation of
    # its own and received every layer: tests/e2e/test_recovery.py's reproduction, before the change).
    gen3 = view(3, ExecutionPlan.even(10, [2, 1], [4, 4], 2), ["a", "b", "c"])
    request, why = plan_request(
        gen3, {1: GEN1, 2: gen2, 3: gen3}, h, ["a", "b", "c", "e"], abandoned=True, keeps_replicas_from=2
    )
    assert request == Request(base=2, plan_from=2, lost=("d",), joined=(), live=("a", "b", "c", "e"), failure=True), why


def test_a_joiner_planned_but_not_switched_to_waits_out_a_loss_like_one_not_planned():
    """A join generation planned (its joiner preparing, nobody switched: everyone still holds only the
    generation before) is the current one when a survivor is lost. The joiner holds nothing of the base
    the loss plans from, so it waits for the recovery's generation to complete a step, as a joiner not
    planned yet does; below the threshold it is needed now."""
    gen2 = view(2, ExecutionPlan.even(10, [2, 3], [4, 4], 2), ["a", "b", "c", "d", "e"])  # e joins gen 1
    gens = {1: GEN1, 2: gen2}
    h = holds(a=(1, 1), b=(1, 1), c=(1, 1), d=(1, 1))  # e's workers: nothing held
    request, why = plan_request(gen2, gens, h, ["a", "b", "c", "e"], keeps_replicas_from=2)  # d lost
    assert request == Request(base=1, plan_from=1, lost=("d",), joined=(), live=("a", "b", "c"), failure=True)
    assert "e (planned to join generation 2, not switched to) join once" in why
    request, _ = plan_request(gen2, gens, h, ["a", "b", "c", "e"], keeps_replicas_from=4)
    assert request.joined == ("e",) and request.live == ("a", "b", "c", "e")
    # Switched and copied (every node holds 2 as well, no step yet): e holds state of the base, it stays.
    h = holds(a=(2, 1), b=(2, 1), c=(2, 1), d=(2, 1), e=(2, 0))
    request, _ = plan_request(gen2, gens, h, ["a", "b", "c", "e"], keeps_replicas_from=2)
    assert request.base == 2 and "e" in request.live and request.joined == ()
