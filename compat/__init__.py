"""Compatibility pass: Scrapy's and scrapy-redis's own tests run against this project's components
(issue 27).

``compat/run.py`` drives it; ``compat/plugin.py`` is the pytest plugin that puts the components in
place.
"""
