"""The api as `pagedq api` builds it (every middleware), plus an async /ping route matched first: the
stack's own cost per request. R=redis://... uvicorn our_stack_app:app --port 8125"""
import os, sys
sys.path.insert(0, "/work/main")
from api.app import create_app
from pagedq.settings import Settings
app = create_app(Settings(redis_url=os.environ["R"], model="/tmp/tinyl"))
@app.get("/ping")
async def ping(): return {"status": "ok"}
# move /ping first so routing cost is comparable to the bare app's
app.router.routes.insert(0, app.router.routes.pop())
