"""The capacity site (testing/capacity.py) behaves as its model says, seen by plain HTTP clients:
at most K served at once per host, the rest first come first served, 503 past 2K, a capacity
changed live, one request answered 429 with Retry-After, keep-alive."""

from __future__ import annotations

import http.client
import time
from concurrent.futures import Future, ThreadPoolExecutor

from testing.capacity import CapacitySite

Reply = tuple[int, dict[str, str], float]


def fetch(site: CapacitySite, host: int = 1, path: str = "/") -> Reply:
    """One GET on a connection of its own: (status, headers, seconds it took)."""
    started = time.monotonic()
    connection = http.client.HTTPConnection(f"127.0.0.{host}", site.port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status, dict(response.getheaders()), time.monotonic() - started
    finally:
        connection.close()


def in_parallel(
    pool: ThreadPoolExecutor, site: CapacitySite, hosts: list[int]
) -> list[Future[Reply]]:
    return [pool.submit(fetch, site, host, f"/{i}") for i, host in enumerate(hosts)]


def test_capacity_requests_at_once_the_rest_first_come_first_served() -> None:
    with CapacitySite(capacity=2, base=0.2) as site, ThreadPoolExecutor(4) as pool:
        host = site.hosts["127.0.0.1"]
        before = time.monotonic()
        futures = in_parallel(pool, site, [1, 1, 1, 1])
        assert site.wait_for(lambda: host.in_flight == 4)  # 2 served, 2 waiting
        assert (host.serving, len(host.waiting)) == (2, 2)
        assert [f.result()[0] for f in futures] == [200] * 4
        after = time.monotonic()
    assert host.answers == {200: 4} and host.most_served == 2 and host.most_in_flight == 4
    assert all(before <= t <= after for t in host.arrivals) and len(host.arrivals) == 4
    served = sorted(host.served)  # by arrival
    starts = [start for _, start, _ in served]
    assert starts == sorted(starts)  # in the order they came
    first_end = min(end for _, _, end in served[:2])
    assert all(start >= first_end for _, start, _ in served[2:])  # the later two waited their turn
    assert all(end - start >= 0.2 for _, start, end in served)
    assert [count for _, count in host.samples][-1] == 0
    times = [t for t, _ in host.samples]
    assert times == sorted(times) and max(count for _, count in host.samples) == 4


def test_past_twice_the_capacity_a_request_is_answered_503_at_once() -> None:
    with CapacitySite(capacity=1, base=0.5) as site, ThreadPoolExecutor(2) as pool:
        host = site.hosts["127.0.0.1"]
        futures = in_parallel(pool, site, [1, 1])
        assert site.wait_for(lambda: host.in_flight == 2)  # 2K: one served, one waiting
        status, _, _ = fetch(site)
        assert status == 503
        assert host.served == []  # answered while the first was still being served
        assert [f.result()[0] for f in futures] == [200, 200]
    assert host.answers == {200: 2, 503: 1} and host.most_in_flight == 2


def test_a_capacity_raised_live_lets_the_waiting_in_at_once() -> None:
    with CapacitySite(capacity=2, base=0.5) as site, ThreadPoolExecutor(4) as pool:
        host = site.hosts["127.0.0.1"]
        futures = in_parallel(pool, site, [1, 1, 1, 1])
        assert site.wait_for(lambda: host.in_flight == 4)  # 2 served, 2 waiting
        site.set_capacity(4)
        assert site.wait_for(lambda: host.serving + len(host.served) == 4)
        assert [f.result()[0] for f in futures] == [200] * 4
    served = sorted(host.served)
    first_end = min(end for _, _, end in served[:2])
    # the waiting ones started at once, while the first two were still being served
    assert all(start < first_end for _, start, _ in served[2:])
    assert host.most_served == 4 and host.capacity == 4


def test_capacity_is_per_host() -> None:
    with CapacitySite(hosts=2, capacity=1, base=0.3) as site, ThreadPoolExecutor(2) as pool:
        futures = in_parallel(pool, site, [1, 2])
        assert [f.result()[0] for f in futures] == [200, 200]
    one, two = (site.hosts[name].served[0] for name in ("127.0.0.1", "127.0.0.2"))
    assert one[1] < two[2] and two[1] < one[2]  # served at the same time
    assert all(h.answers == {200: 1} and h.most_served == 1 for h in site.hosts.values())


def test_one_chosen_request_is_answered_429_with_retry_after() -> None:
    with CapacitySite(hosts=2, capacity=2, base=0.01) as site:
        site.too_many("127.0.0.2", retry_after=3, nth=2)
        assert fetch(site, 2)[0] == 200
        assert fetch(site, 1)[0] == 200  # another host's arrivals do not count
        status, headers, _ = fetch(site, 2)
        assert (status, headers["Retry-After"]) == (429, "3")
        assert fetch(site, 2)[0] == 200
    assert site.hosts["127.0.0.2"].answers == {200: 2, 429: 1}
    assert site.hosts["127.0.0.1"].answers == {200: 1}


def test_connections_are_kept_alive() -> None:
    with CapacitySite(capacity=1, base=0.01) as site:
        connection = http.client.HTTPConnection("127.0.0.1", site.port, timeout=10)
        try:
            for path in ("/a", "/b", "/c"):
                connection.request("GET", path)
                response = connection.getresponse()
                assert (response.status, response.read()) == (
                    200,
                    f"127.0.0.1 {path} 200\n".encode(),
                )
        finally:
            connection.close()
    assert site.hosts["127.0.0.1"].connections == 1
