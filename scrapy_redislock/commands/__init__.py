"""Scrapy commands of scrapy_redislock: ``scrapy redislock ...``.

Registered through the ``scrapy.commands`` entry point (setup.cfg); without installing the package,
set ``COMMANDS_MODULE = "scrapy_redislock.commands"`` in the project's settings.py instead.
"""
