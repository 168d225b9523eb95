"""Rules of the movable-task pool (issue 9, item E2): the W tasks of one chunk run in microbatch
order, so a W may run early only once every earlier microbatch of its chunk is registered (or
done); otherwise gradient accumulation order, and bitwise equality with the reference, breaks."""

from __future__ import annotations

from tessera.engine.pool import MovablePool, MovableTask, OldestFirst


def _fill_slot(pool: MovablePool, policy, ran: list) -> None:
    """What the engine does at a ``slot``: run each selected task with its due predecessors."""
    for task in policy.select(None, pool):
        for t in pool.due(task):
            ran.append(t)
            pool.mark_done(t)


def test_w_waits_for_an_unregistered_earlier_microbatch():
    pool, policy, ran = MovablePool(), OldestFirst(max_tasks=4), []
    for t in (MovableTask(0, 1), MovableTask(0, 2), MovableTask(1, 0)):
        pool.register(t)  # chunk 0's mb0 is not registered yet (its B has not run)
    assert [pool.eligible(t) for t in pool.pending()] == [False, False, True]
    assert policy.select(None, pool) == (MovableTask(1, 0),)
    _fill_slot(pool, policy, ran)
    assert ran == [MovableTask(1, 0)]
    assert pool.pending() == (MovableTask(0, 1), MovableTask(0, 2))
    pool.register(MovableTask(0, 0))
    assert all(pool.eligible(t) for t in pool.pending())
    assert pool.due(MovableTask(0, 2)) == (MovableTask(0, 0), MovableTask(0, 1), MovableTask(0, 2))
    _fill_slot(pool, policy, ran)
    assert ran == [MovableTask(1, 0), MovableTask(0, 0), MovableTask(0, 1), MovableTask(0, 2)]
    assert len(pool) == 0


def test_done_earlier_microbatches_count_and_gaps_do_not():
    pool = MovablePool()
    pool.register(MovableTask(2, 0))
    pool.mark_done(MovableTask(2, 0))
    pool.register(MovableTask(2, 1))
    pool.register(MovableTask(2, 3))  # mb2 of chunk 2 missing
    assert pool.eligible(MovableTask(2, 1)) and not pool.eligible(MovableTask(2, 3))
    assert not pool.eligible(MovableTask(2, 2))  # not pending at all
    assert OldestFirst(max_tasks=5).select(None, pool) == (MovableTask(2, 1),)
