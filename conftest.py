"""Repository-level pytest configuration.

The plugin itself is loaded through its ``pytest11`` entry point (``pip install -e .``), so
nothing here registers it. This file only keeps ``pytest`` run from the repository root
away from folders that hold scripts rather than tests.
"""

collect_ignore = ["bench", "ci", "fixtures", "reports"]
