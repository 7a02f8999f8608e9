"""The operator's tools: the command line (``python -m scrapy_redislock``), the dashboard and
``/metrics``, ACL roles. Nothing below imports them."""
