"""Collection of the whole project (the tests, and the doctests of memguard/)."""

# These import their framework (TensorFlow, Lightning, transformers; torch for Lightning's
# step) when imported: collected for their doctests in the test process, they would put the
# frameworks' hundreds of thousands of objects in the heap of every run, for every later full
# collection to walk.
# tests/test_integrations_doctests.py runs their examples in a process of its own.
FRAMEWORK_MODULES = ["memguard/integrations/keras.py", "memguard/integrations/lightning.py",
                     "memguard/integrations/_lightning_step.py",
                     "memguard/integrations/transformers.py",
                     "memguard/integrations/_transformers_step.py"]
collect_ignore = list(FRAMEWORK_MODULES)
