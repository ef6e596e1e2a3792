"""Token-weighted fair share between tenants, on fabricated service: a flood cannot starve a light tenant, and a
tenant coming back cannot spend credit saved while it was away."""

from __future__ import annotations

from switchyard.scheduler.tenant_share import TenantShare


def serve(share: TenantShare, queued: dict[str, int], steps: int, cost: dict[str, int]) -> list[str]:
    """Pull ``steps`` requests, each charged ``cost[tenant]`` tokens; returns who was served, in order."""
    served = []
    for _ in range(steps):
        backlogged = [t for t, n in queued.items() if n]
        if not backlogged:
            break
        share.set_backlogged(backlogged)
        tenant = share.order(backlogged)[0]
        queued[tenant] -= 1
        share.charge(tenant, prompt_tokens=cost[tenant], generated_tokens=cost[tenant])
        served.append(tenant)
    return served


def test_a_flood_shares_service_with_a_light_tenant_by_tokens():
    share = TenantShare()
    served = serve(share, {"heavy": 100, "light": 10}, 20, {"heavy": 100, "light": 100})
    # Alternating while both are backlogged: all ten light requests within the first twenty served, never two
    # heavy ones in a row before the light tenant's queue is empty.
    assert served.count("light") == 10
    last_light = max(i for i, t in enumerate(served) if t == "light")
    assert all(not (served[i] == served[i + 1] == "heavy") for i in range(last_light))


def test_service_is_shared_by_tokens_not_requests():
    share = TenantShare()
    served = serve(share, {"long": 50, "short": 50}, 40, {"long": 400, "short": 100})
    # Equal tokens: four short requests for each long one.
    assert abs(served.count("short") - 4 * served.count("long")) <= 4


def test_a_returning_tenant_is_lifted_to_the_others_and_cannot_burst():
    share = TenantShare()
    serve(share, {"a": 30, "b": 30}, 40, {"a": 10, "b": 10})  # both got ~20 requests of service
    share.set_backlogged(["a", "b"])
    share.charge("a", 1000)  # a keeps going alone for a while...
    share.set_backlogged(["a"])
    share.charge("a", 5000)
    share.set_backlogged(["a", "new"])  # ...then a tenant never seen arrives: it starts level with a
    assert share.counter("new") == share.counter("a")
    served = serve(share, {"a": 10, "new": 10}, 10, {"a": 10, "new": 10})
    assert 4 <= served.count("new") <= 6, served  # alternating, not ten in a row


def test_forget_keeps_the_queued_tenants():
    share = TenantShare()
    share.charge("gone", 5)
    share.set_backlogged(["here"])
    share.charge("here", 5)
    share.forget(keep=[])
    assert (share.counter("gone"), share.counter("here")) == (0.0, 5.0)


def test_a_drained_tenant_is_no_longer_backlogged_and_comes_back_lifted():
    share = TenantShare()
    share.set_backlogged(["a", "b"])
    share.charge("a", 100)
    share.drained("b")
    assert share.tenant_state()["fair_share_backlogged"] == 1
    share.charge("a", 100)
    share.set_backlogged(["a", "b"])  # b rings again: lifted level with a, not left behind with its old counter
    assert share.counter("b") == share.counter("a") == 200.0


def test_idle_tenants_counters_are_bounded():
    from switchyard.scheduler.tenant_share import MAX_IDLE_COUNTERS

    share = TenantShare()
    share.set_backlogged(["busy"])
    for i in range(MAX_IDLE_COUNTERS + 10):
        share.charge(f"t{i}", 1)
    share.charge("busy", 7)
    assert share.counter("busy") == 7.0 and len(share._counters) <= MAX_IDLE_COUNTERS + 1


def test_between_equally_served_tenants_the_one_queued_longest_goes_first():
    share = TenantShare()
    share.set_backlogged(["zed"])
    share.set_backlogged(["zed", "amy"])  # both at 0: zed has been waiting longer, whatever the names say
    assert share.order(["amy", "zed"]) == ["zed", "amy"]
    share.set_backlogged(["amy"])  # zed served and gone, back later: behind amy, who waited meanwhile
    share.set_backlogged(["amy", "zed"])
    assert share.order(["amy", "zed"]) == ["amy", "zed"]


def test_a_light_tenant_lifted_with_many_goes_before_those_that_were_served_more():
    share = TenantShare()
    busy = [f"busy{i}" for i in range(50)]
    share.set_backlogged(busy + ["light"])
    for tenant in busy:  # each got a long request's service; the light tenant a short one
        share.charge(tenant, prompt_tokens=10, generated_tokens=400)
    share.charge("light", prompt_tokens=10, generated_tokens=8)
    share.set_backlogged(["waiting"])  # everyone's request done; one tenant still queued, served nothing yet
    share.charge("waiting", prompt_tokens=1000)  # ...until now: the floor the others come back to
    share.set_backlogged(["waiting"] + busy)  # the long requests' tenants come back first
    share.set_backlogged(["waiting"] + busy + ["light"])  # the light one a moment later
    order = share.order(["waiting"] + busy + ["light"])
    assert share.counter("light") == share.counter("busy0") == share.counter("waiting")  # all lifted level
    assert order[0] == "light"  # served least before the lift: first among equals, not behind fifty


def test_a_light_tenant_a_little_above_many_level_tenants_goes_before_their_long_requests():
    """A thousand tenants level at one long request each, every one waiting for its next long request, and a light
    tenant a few short requests above them: by counters alone it waited until every one of them had had its long
    request (a whole round of the seats: tens of seconds). Its next request is expected to be short, theirs long:
    it goes first, and only while its counter plus a short request stays below theirs plus a long one."""
    share = TenantShare()
    busy = [f"busy{i:04d}" for i in range(1000)]
    share.set_backlogged(busy + ["light"])
    for tenant in busy:
        share.charge(tenant, prompt_tokens=10, generated_tokens=400)
        share.finished(tenant, prompt_tokens=10, generated_tokens=400)
    for _ in range(32):  # 32 short requests: a little more service than any one of them
        share.charge("light", prompt_tokens=10, generated_tokens=8)
        share.finished("light", prompt_tokens=10, generated_tokens=8)
    assert share.counter("light") > share.counter("busy0000")
    assert share.order(busy + ["light"])[0] == "light"
    share.charge("light", generated_tokens=400)  # far ahead now: their turn
    assert share.order(busy + ["light"])[-1] == "light"


def test_a_tenant_never_seen_finishing_is_expected_to_cost_nothing_and_forget_drops_its_guess():
    share = TenantShare()
    share.set_backlogged(["old", "new"])
    share.charge("old", prompt_tokens=5)
    share.finished("old", prompt_tokens=5, generated_tokens=100)
    assert share.order(["old", "new"]) == ["new", "old"]
    share.set_backlogged([])
    share.forget(keep=())
    assert share._last_cost == {}
