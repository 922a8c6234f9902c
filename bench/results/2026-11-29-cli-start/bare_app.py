"""A bare FastAPI app (an async and a sync route) for the floor of one request on this uvicorn:
    uvicorn bare_app:app --port 8124 --log-level warning|info"""
from fastapi import FastAPI
app = FastAPI()
@app.get("/health")
async def health(): return {"status": "ok"}
@app.get("/version")
def version(): return {"status": "ok"}
