"""``import memguard`` stays light: no framework until the program imports one."""


def test_import_memguard_imports_no_framework(python_in_subprocess):
    out = python_in_subprocess("""
        import json, sys
        import memguard
        heavy = [m for m in ("torch", "tensorflow", "wrapt", "psutil", "numpy") if m in sys.modules]
        snap = memguard.snapshot()
        memguard.free_memory()
        with memguard.memory_scope():
            pass
        print(json.dumps({"heavy": heavy, "devices": list(snap.devices),
                          "after_use": [m for m in ("torch", "tensorflow") if m in sys.modules]}))
    """)
    assert out == {"heavy": [], "devices": ["host"], "after_use": []}


def test_framework_backend_activates_once_the_program_imports_it(python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import memguard
        from memguard.backends import active_backends
        before = [b.name for b in active_backends()]
        import torch
        after = [b.name for b in active_backends()]
        print(json.dumps({"before": before, "after": after,
                          "cuda_initialised": torch.cuda.is_initialized()}))
    """)
    assert out == {"before": ["host"], "after": ["host", "torch"], "cuda_initialised": False}


def test_activate_imports_the_framework_on_request(python_in_subprocess):
    out = python_in_subprocess("""
        import json, sys
        import memguard
        backend = memguard.activate("torch")
        print(json.dumps({"name": backend.name, "imported": "torch" in sys.modules}))
    """)
    assert out == {"name": "torch", "imported": True}
