"""The example crawl: `python -m example_project.run` (or `./run.sh demo` from a fresh checkout)."""
