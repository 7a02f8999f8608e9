"""The test harness, outside the package: Redis servers, the fake shop site, process helpers.

Used by the tests, the benchmarks and the example crawl; never shipped in the wheel."""
