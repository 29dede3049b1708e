"""Generator programs (each with a ``main()``): shipped cluster profiles, JSON Schemas, the README pictures.

Run from the repository root: ``python -m tools.hardware_catalog``, ``python -m tools.schema_export``,
``python -m tools.docs_pictures --out docs``. They use the library; the library never uses them.
"""
