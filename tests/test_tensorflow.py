"""TensorFlow programs: CPU tensors are host memory; GPUs are read only once TF uses them."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                       reason="needs TensorFlow"),
]
# Each test runs in its own interpreter: TensorFlow's CPU pool would blur every RSS figure
# of the tests around it.


def test_backend_is_active_lists_only_gpus_and_clears_keras_only_on_request(
        python_in_subprocess):
    out = python_in_subprocess("""
        import json
        import keras
        import tensorflow as tf
        import memguard
        from memguard.backends import active_backends
        tf.constant(1.0)  # start the runtime: its GPUs, if any, can be read now
        names = [keras.layers.Dense(1).name for _ in range(2)]
        memguard.free_memory()
        names.append(keras.layers.Dense(1).name)
        memguard.free_memory(keras=True)
        names.append(keras.layers.Dense(1).name)
        print(json.dumps({"backends": [b.name for b in active_backends()],
                          "gpus": len(tf.config.list_physical_devices("GPU")),
                          "devices": memguard.list_devices(), "names": names}))
    """)
    assert out["backends"] == ["host", "tensorflow"]
    assert out["devices"] == ["host"] + [f"GPU:{i}" for i in range(out["gpus"])]
    first, second, third, fourth = out["names"]
    assert len({first, second, third}) == 3 and fourth == first


def test_pooled_cpu_memory_is_reused_instead_of_piling_up(python_in_subprocess):
    """With oneDNN (TensorFlow's default on x86) freed CPU tensors go back to TensorFlow's own
    pool, not to the system: the resident set cannot drop, but what a scope frees is reused,
    while cycles nobody collects pile up."""
    out = python_in_subprocess("""
        import gc, json
        import tensorflow as tf
        import memguard
        from memguard.backends import host
        MiB = 2**20
        gc.disable()

        def tf_cycle(mib):
            holder = [tf.ones((mib * MiB // 4,))]
            holder.append(holder)

        start = host.rss()
        for _ in range(5):
            with memguard.memory_scope():
                tf_cycle(200)
        scoped = host.rss() - start
        start = host.rss()
        for _ in range(5):
            tf_cycle(200)
        print(json.dumps({"scoped": scoped / MiB, "bare": (host.rss() - start) / MiB}))
    """, env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert out["scoped"] < 450  # one or two 200 MB blocks of the pool, reused five times
    assert out["bare"] > 600  # five 200 MB tensors, whatever the pool had free


RELEASE_TO_SYSTEM = {"TF_ENABLE_ONEDNN_OPTS": "0"}  # TensorFlow's plain allocator frees at once


def test_scope_releases_and_reports_tensorflow_memory(python_in_subprocess):
    out = python_in_subprocess("""
        import gc, json
        import tensorflow as tf
        import memguard
        from memguard.backends import host
        MiB = 2**20
        gc.disable()
        with memguard.memory_scope() as cycle:
            holder = [tf.ones((200 * MiB // 4,))]
            holder.append(holder)
            del holder
        with memguard.memory_scope() as kept_scope:
            kept = tf.ones((200 * MiB // 4,))

        @tf.function
        def double(x):
            return x * 2

        @memguard.frees_memory
        def step():
            holder = [double(tf.ones((100 * MiB // 4,)))]
            holder.append(holder)

        step()
        start = host.rss()
        for _ in range(3):
            step()
        print(json.dumps({
            "cycle_peak": (cycle.peak["host"] - cycle.before["host"].reserved) / MiB,
            "cycle_retained": cycle.retained["host"] / MiB, "cycle_freed": cycle.freed / MiB,
            "kept_retained": kept_scope.retained["host"] / MiB,
            "steps_grew": (host.rss() - start) / MiB}))
    """, env=RELEASE_TO_SYSTEM)
    assert out["cycle_peak"] > 180 and out["cycle_retained"] < 30 and out["cycle_freed"] > 150
    assert 180 < out["kept_retained"] < 230
    assert out["steps_grew"] < 40


def test_looking_does_not_start_the_tensorflow_runtime(python_in_subprocess):
    """Reading memory, freeing it and a scope leave TensorFlow's runtime unstarted (starting
    it takes every GPU's memory), and memguard tells a started runtime from one that is not."""
    out = python_in_subprocess("""
        import json
        import tensorflow as tf
        from tensorflow.python.eager import context
        import memguard
        from memguard.backends import tensorflow as tf_backend
        snap = memguard.snapshot()
        memguard.free_memory()
        with memguard.memory_scope():
            pass
        tf_backend.TensorFlowBackend().devices()
        before = [tf_backend._runtime_started(), bool(context.context()._initialized)]
        tf.constant(1.0)
        print(json.dumps({"before": before, "after": tf_backend._runtime_started(),
                          "devices": list(snap)}))
    """)
    assert out == {"before": [False, False], "after": True, "devices": ["host"]}


def test_tensorflow_only_program_inference_mode_cleans(python_in_subprocess):
    out = python_in_subprocess("""
        import gc, json, sys
        import tensorflow as tf
        import memguard
        from memguard.backends import host
        gc.disable()
        start = host.rss()
        with memguard.inference_mode():
            holder = [tf.ones((200 * 2**20 // 4,))]
            holder.append(holder)
            del holder
        print(json.dumps({"torch": "torch" in sys.modules,
                          "left_mib": (host.rss() - start) / 2**20}))
    """, env=RELEASE_TO_SYSTEM)
    assert out["torch"] is False and out["left_mib"] < 40


def test_tensorflows_cpu_pool_counts_as_reusable_under_an_address_space_budget(
        python_in_subprocess):
    # TensorFlow's CPU allocator keeps freed tensors' memory mapped in its pool: address
    # space used, yet free for its next tensors, which the next attempt's size must count
    out = python_in_subprocess("""
        import json
        import tensorflow as tf
        import memguard
        from memguard.backends.budget import budgets
        with memguard.memory_limit("2GiB", device="host"):
            x = tf.random.normal((64, 2**20))  # 256 MiB
            float(tf.reduce_sum(x))
            del x
            budget = budgets("host")[0]
        print(json.dumps({"kind": budget.kind, "reusable": budget.reusable,
                          "used": budget.used}))
    """)
    assert out["kind"] == "memory_limit"
    assert out["reusable"] >= 250 * 2**20, out  # the freed 256 MiB, still mapped


def test_a_tensor_kept_in_tensorflows_onednn_pool_is_retained(python_in_subprocess):
    # oneDNN's pool cuts tensors from blocks it took from malloc once: mallinfo2 barely moves
    # when a block keeps one, the pool's own in-use figure does. TensorFlow's import objects
    # are frozen first, as tests/conftest.py freezes torch's: a scope that finds a leak makes
    # three full collections, each walking TensorFlow's 300,000 objects (0.3 s a scope, 3 s
    # of the test; 0.01 s frozen). What the snippet makes is collected as before.
    out = python_in_subprocess("""
        import gc, json
        import tensorflow as tf
        import memguard
        gc.collect()
        gc.freeze()
        MiB = 2**20
        float(tf.reduce_sum(tf.random.normal((4 * MiB,))))  # the pool's first blocks
        kept, raised, idle = [], 0, []
        for _ in range(10):
            try:
                with memguard.memory_scope(max_leak="1MiB"):
                    kept.append(tf.random.normal((MiB,)))  # 4 MiB
            except memguard.MemoryLeakError:
                raised += 1
        for _ in range(10):
            with memguard.memory_scope() as scope:
                float(tf.reduce_sum(tf.random.normal((MiB,))))  # 4 MiB, freed
            idle.append(scope.retained["host"] / MiB)
        print(json.dumps({"raised": raised, "idle": idle}))
    """, env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert out["raised"] == 10
    assert max(out["idle"]) < 0.5, out["idle"]
