"""The coordinator's HTTP plumbing, shared by its route modules: parsing bodies and query
identities into models, JSON answers, and the one place that turns an exception into a
status code (`error_middleware`). No decisions and no state: server.py has those."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from transom.coordinator.identity import Principal
from transom.coordinator.models import ErrorBody, Identity
from transom.errors import (
    CoordinatorError,
    Evicted,
    Forbidden,
    JobCompleted,
    NotRegistered,
    TooManyRequests,
)

log = logging.getLogger("transom.coordinator")
M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 1 << 20

# Where the auth middleware leaves the caller (a typed key where aiohttp has them, 3.12+).
PRINCIPAL = web.RequestKey("principal", Principal) if hasattr(web, "RequestKey") else "principal"
# The incarnation a call is about, and what it was about to do (/v1/fence): a 409 names them.
SUBJECT = web.RequestKey("subject", tuple) if hasattr(web, "RequestKey") else "subject"


class BadRequest(Exception):
    pass


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def error(status: int, message: str, retry: bool = False, state: str | None = None) -> web.Response:
    body = ErrorBody(error=message, retry=retry, state=state).model_dump_json(exclude_none=True)
    return web.Response(status=status, text=body, content_type="application/json")


def ok(model: BaseModel | dict | None = None) -> web.Response:
    if isinstance(model, BaseModel):
        return web.Response(text=model.model_dump_json(), content_type="application/json")
    return web.json_response(model or {})


async def parse(request: web.Request, model: type[M]) -> M:
    try:
        raw = await request.read()
        data = json.loads(raw)
    # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integer literals;
    # RecursionError is what json raises on deeply nested arrays or objects.
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        reasons = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise BadRequest(f"invalid {model.__name__}: {reasons}") from None


def query_identity(request: web.Request, replica_id: str) -> Identity:
    try:
        return Identity(
            replica_id=int(replica_id),
            generation=int(request.query.get("generation", "0")),
            attempt=int(request.query.get("attempt", "0")),
        )
    except (ValueError, ValidationError) as e:
        raise BadRequest(f"replica id, generation and attempt must be small non-negative integers: {e}") from None


def error_middleware(refused: Callable[[web.Request, Evicted], web.Response]):
    """Errors a client can cause as 4xx JSON bodies, ours as 500; `refused` answers the 409
    of an incarnation that is no longer current (it counts and tells: fencing.py)."""

    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400:
                return error(e.status, e.reason)
            raise
        except (BadRequest, ValueError) as e:
            return error(400, str(e))
        except Forbidden as e:
            return error(403, str(e))
        except TooManyRequests as e:
            return error(429, str(e), retry=True)
        except Evicted as e:
            return refused(request, e)
        except NotRegistered as e:
            return error(404, str(e))
        except JobCompleted as e:
            return error(410, str(e))
        except CoordinatorError as e:  # an identity provider that did not answer (TokenReview)
            return error(503, str(e), retry=True)
        except Exception:  # a bug of ours: answer 500, keep serving every other replica
            log.exception("internal error handling %s %s", request.method, request.path)
            return error(500, "internal error", retry=True)

    return errors
