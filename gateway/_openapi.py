"""The admin API's OpenAPI document, built from the same route table that serves it.

Each :class:`Operation` names its pydantic request and response models; their JSON
schemas become ``components/schemas``. So the document cannot drift from the handlers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

__all__ = ["Operation", "openapi_document"]

_REF = "#/components/schemas/{model}"


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    summary: str
    body: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    status: int = 200


def openapi_document(title: str, version: str, operations: list[Operation]) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": f"{op.method.lower()}_{op.path.strip('/').replace('/', '_')}"
                           .replace("{", "").replace("}", ""),
            "responses": {
                str(op.status): _response(op.response, schemas),
                "400": _error("Invalid request"),
                "401": _error("Missing or wrong bearer token"),
                "404": _error("Unknown candidate"),
                "409": _error("Conflict with the current state"),
                "422": _error("Validation failed"),
                "503": _error("The store could not take the change in time; nothing was "
                              "applied (type store_unavailable)"),
            },
        }
        if op.body is not None:
            entry["responses"]["413"] = _error("Body over the admin API's limit")
        parameters = [
            {"name": part[1:-1], "in": "path", "required": True,
             "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]+$", "maxLength": 64}}
            for part in op.path.split("/") if part.startswith("{")
        ]
        if parameters:
            entry["parameters"] = parameters
        if op.body is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _schema(op.body, schemas)}},
            }
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",  # its schemas are JSON Schema 2020-12, as pydantic emits
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {}, "code": {"type": "integer"}}}},
}


def _schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF, mode="validation")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _response(model: type[BaseModel] | None, schemas: dict[str, Any]) -> dict[str, Any]:
    if model is None:
        return {"description": "OK"}
    return {"description": "OK",
            "content": {"application/json": {"schema": _schema(model, schemas)}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
