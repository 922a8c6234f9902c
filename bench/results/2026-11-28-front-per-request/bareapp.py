from fastapi import FastAPI
from pydantic import BaseModel
app = FastAPI()
class B(BaseModel):
    prompt: str
    max_tokens: int
@app.get("/x/{i}")
async def x(i: str): return {"seq_id": i}
@app.post("/p", status_code=202)
async def p(b: B): return {"seq_id": "a"}
