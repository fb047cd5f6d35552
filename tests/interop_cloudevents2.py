"""Run by the interop test in .venv/cloudevents2: decodes each request (a JSON list on stdin of
{"headers": {...}, "body": base64}) with the CloudEvents SDK 2.x and prints each event's attributes
and data as a JSON list."""

import base64
import json
import sys

from cloudevents.core.bindings.http import HTTPMessage, from_http_event

events = []
for request in json.load(sys.stdin):
    event = from_http_event(HTTPMessage(headers=request["headers"], body=base64.b64decode(request["body"])))
    attributes = {name: str(value) for name, value in event.get_attributes().items()}
    data = event.get_data()
    events.append({"attributes": attributes,
                   "data": base64.b64encode(data).decode() if isinstance(data, bytes) else data})
json.dump(events, sys.stdout)
