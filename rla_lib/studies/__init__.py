"""The studies behind single notebooks: each answers one chapter's question with the core (`rla_lib`), and the core
imports none of them (tests/test_layout.py).

shapley (04), location_clustering and prerounding (01, 05), spread (07); arms (the named GRPO
training arms and running many of them), stability, collapse and dose_response (06a, 06b).
"""
