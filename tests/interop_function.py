"""A Cloud Functions-style function for the interop test: run by functions-framework as its own
process (declared for CloudEvents), it writes every event it receives as a JSON line."""

import json
import os

import functions_framework


@functions_framework.cloud_event
def receive(event):  # type: ignore[no-untyped-def]
    with open(os.environ["RECEIVED_FILE"], "a", encoding="utf-8") as out:
        out.write(json.dumps({"type": event["type"], "id": event["id"], "source": event["source"],
                              "data": event.data}) + "\n")
