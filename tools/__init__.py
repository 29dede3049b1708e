"""Generator programs (each with a ``main()``): the JSON Schemas and the README pictures.

Run from the repository root: ``python -m tools.schema_export``, ``python -m tools.docs_pictures --out docs``.
They use the library; the library never uses them. (The datasheet catalog stays in
``planner/profile/hardware_catalog.py``: the cluster-profile migration reads its kernel models.)
"""
