"""The HTTP routes, one APIRouter a module; each reaches the services `create_app` built through the
dependencies in `deps.py`."""
