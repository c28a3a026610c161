"""The rev88 HTTP service (FastAPI on uvicorn): ``app.main:create_app``.

Thin web layer over ``learner``: uploads and limits (uploads.py), the device
queue (executor.py), the task path (submit.py, tasks.py), health (health.py),
metrics (metrics.py), settings from REV88_* variables (settings.py).
"""
