"""Measurement tools: `treeserve bench` (load a running gateway), the serving tables in one command, the
transport, verification and kernel benches, outside baselines and the checks run on their output. They sit
above the services, which never import them (tests/test_layout.py)."""
