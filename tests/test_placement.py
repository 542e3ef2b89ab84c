from __future__ import annotations

from prorsa.policy.placement import PlacementSettings, pool_worthy, sheds_load, stays_local

S = PlacementSettings()


def test_short_appends_to_a_held_context_stay_local() -> None:
    assert not pool_worthy(S, holds_prefix=True, new_tokens=500)
    assert pool_worthy(S, holds_prefix=True, new_tokens=5000)  # a long observation
    assert pool_worthy(S, holds_prefix=False, new_tokens=10)  # evicted or first turn


def test_pool_worthy_work_stays_local_when_the_pool_is_saturated_or_would_recompute() -> None:
    assert stays_local(
        S, holds_prefix=False, new_tokens=4000, pool_queue_s=5.0, pool_compute_tokens=4000
    )
    assert stays_local(
        S, holds_prefix=True, new_tokens=2000, pool_queue_s=0.1, pool_compute_tokens=30000
    )
    assert not stays_local(
        S, holds_prefix=True, new_tokens=2000, pool_queue_s=0.1, pool_compute_tokens=2500
    )
    assert not stays_local(
        S, holds_prefix=False, new_tokens=4000, pool_queue_s=0.1, pool_compute_tokens=40000
    )


def test_rebalance_only_clearly_overloaded_workers_or_towards_an_idle_one() -> None:
    assert not sheds_load(S, hosted=20, mean_hosted=16.0, least_hosted=12)
    assert sheds_load(S, hosted=23, mean_hosted=16.0, least_hosted=12)
    # a worker that just joined the decode pool takes the surplus of any above the mean
    assert sheds_load(S, hosted=17, mean_hosted=16.0, least_hosted=7)
    assert not sheds_load(S, hosted=16, mean_hosted=16.0, least_hosted=0)
    assert not sheds_load(S, hosted=17, mean_hosted=16.0, least_hosted=8)
