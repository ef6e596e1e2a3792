"""The failed-key throttle's bookkeeping, with its clock given: who counts as the client, and when it may retry."""

from __future__ import annotations

import ipaddress

from switchyard.gateway.gatekeeper import FailedKeys, client_address


def test_an_address_may_try_again_once_its_oldest_failure_is_a_minute_old():
    failures = FailedKeys(per_minute=3)
    for t in (0.0, 10.0, 20.0):
        assert failures.wait_s("a", now=t) is None
        failures.failed("a", now=t)
    assert failures.wait_s("a", now=30.0) == 30.0  # the failure at 0 s leaves the window at 60 s
    assert failures.wait_s("b", now=30.0) is None  # another address is not affected
    assert failures.wait_s("a", now=60.0) is None



def test_addresses_that_stopped_trying_are_forgotten_once_their_failures_leave_the_window():
    failures = FailedKeys(per_minute=3)
    for address in ("gone", "staying"):
        failures.failed(address, now=0.0)
    failures.failed("staying", now=50.0)
    assert failures.wait_s("anyone", now=70.0) is None  # a request from anyone sweeps, once a window
    assert set(failures._failures) == {"staying"}
    assert failures.wait_s("anyone", now=130.0) is None
    assert failures._failures == {}


def test_forwarded_addresses_are_believed_from_trusted_proxies_only():
    scope = {"client": ("10.0.0.5", 1234), "headers": [(b"x-forwarded-for", b"6.6.6.6, 1.2.3.4")]}
    assert client_address(scope, []) == "10.0.0.5"
    assert client_address(scope, [ipaddress.ip_network("10.0.0.0/8")]) == "1.2.3.4"  # the proxy's own entry
    assert client_address(scope, [ipaddress.ip_network("192.168.0.0/16")]) == "10.0.0.5"
