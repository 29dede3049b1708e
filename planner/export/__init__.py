"""Export a plan to Megatron-LM, torchtitan, DeepSpeed or Accelerate, and import their configs.

    export_plan(plan, "megatron", profile=..., cluster=...) -> Export   (text, changes, both estimates)
    import_config("deepspeed", text, ...) -> FrameworkSettings

See ``settings.py`` (the common record), ``nearest.py`` (what each framework can express) and one module
per framework for its format and sources.
"""
