"""Twenty JSON schemas of extraction and classification jobs, each with a prompt that asks for it
(tests/test_structured_outputs_model.py). They use what such jobs use: nested objects, arrays with
bounds, enums, required and optional fields, integers and numbers with ranges, booleans, strings
with length bounds, patterns and formats (date, date-time, email, uuid), const, anyOf and nullable
fields. A string is bounded by maxLength, a pattern or a fixed-length format: a small model left an
unbounded string can run on to max_tokens (xgrammar enforces no length on a string with a format)."""

from __future__ import annotations

SHORT_TEXT = {"type": "string", "minLength": 1, "maxLength": 40}

SCHEMAS: list[tuple[str, dict]] = [
    ("Extract the person: Ann Lee is 31 and lives in Oslo.", {
        "type": "object",
        "properties": {"name": SHORT_TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                       "city": SHORT_TEXT},
        "required": ["name", "age", "city"], "additionalProperties": False}),
    ("Classify the sentiment of: 'The food was cold and the waiter rude.'", {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"]}),
    ("List three fruits with their colours.", {
        "type": "object",
        "properties": {"fruits": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": SHORT_TEXT, "colour": {"enum": ["red", "yellow", "green",
                                                                                     "orange", "purple"]}},
            "required": ["name", "colour"]}}},
        "required": ["fruits"]}),
    ("Give the invoice: number INV-2041, total 99.5 EUR, paid.", {
        "type": "object",
        "properties": {"invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                       "total": {"type": "number", "minimum": 0},
                       "currency": {"enum": ["EUR", "USD", "GBP"]}, "paid": {"type": "boolean"}},
        "required": ["invoice_number", "total", "currency", "paid"]}),
    ("Extract the contact of Bob: bob@example.com, born 1990-04-12.", {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email"},
                       "birth_date": {"type": "string", "format": "date"}},
        "required": ["email", "birth_date"]}),
    ("Describe a book as JSON.", {
        "type": "object",
        "properties": {"title": SHORT_TEXT, "author": {"type": "object", "properties": {
            "first_name": SHORT_TEXT, "last_name": SHORT_TEXT}, "required": ["first_name", "last_name"]},
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]},
                       "maxItems": 2}},
        "required": ["title", "author", "year"]}),
    ("Is this email spam? 'You won a prize, click here.'", {
        "type": "object",
        "properties": {"is_spam": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
        "required": ["is_spam", "reason"]}),
    ("Rate this product review from 1 to 5: 'Works fine, a bit loud.'", {
        "type": "object",
        "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                       "aspects": {"type": "array", "items": {"enum": ["price", "quality", "noise", "size"]},
                                   "maxItems": 4}},
        "required": ["rating"]}),
    ("Give a product id and its web page.", {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"},
                       "url": {"type": "string", "pattern": "^https://[a-z]{1,20}[.](com|org)(/[a-z]{1,12})?$"}},
        "required": ["id", "url"]}),
    ("Extract the address: 12 Main Street, Springfield, 62704, USA.", {
        "type": "object",
        "properties": {"street": SHORT_TEXT, "city": SHORT_TEXT,
                       "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "country": {"type": "string", "enum": ["USA", "Canada", "Mexico"]}},
        "required": ["street", "city", "postal_code", "country"]}),
    ("Tag the language of: 'Bonjour tout le monde'.", {
        "type": "object",
        "properties": {"language": {"type": "string", "pattern": "^[a-z]{2}$"}, "script": {"const": "Latin"}},
        "required": ["language", "script"]}),
    ("Give a meeting with its time and attendees.", {
        "type": "object",
        "properties": {"topic": SHORT_TEXT, "start": {"type": "string", "format": "date-time"},
                       "attendees": {"type": "array", "minItems": 1, "maxItems": 3,
                                     "items": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}[.](com|org)$"}}},
        "required": ["topic", "start", "attendees"]}),
    ("Give an order with line items.", {
        "type": "object",
        "properties": {"order_id": {"type": "integer", "minimum": 1},
                       "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                           "type": "object",
                           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                                          "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                          "price": {"type": "number", "minimum": 0}},
                           "required": ["sku", "quantity", "price"]}}},
        "required": ["order_id", "items"]}),
    ("Which department handles this ticket: 'My card was charged twice.'", {
        "type": "object",
        "properties": {"department": {"enum": ["billing", "shipping", "technical", "sales"]},
                       "priority": {"enum": ["low", "medium", "high"]}},
        "required": ["department", "priority"]}),
    ("Give the weather for Paris.", {
        "type": "object",
        "properties": {"city": SHORT_TEXT, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                       "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                       "wind_kmh": {"type": ["integer", "null"], "minimum": 0, "maximum": 300}},
        "required": ["city", "temperature_c", "conditions", "wind_kmh"]}),
    ("Give a user profile.", {
        "type": "object",
        "properties": {"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                       "settings": {"type": "object", "properties": {
                           "theme": {"enum": ["light", "dark"]}, "notifications": {"type": "boolean"}},
                           "required": ["theme", "notifications"]}},
        "required": ["username", "settings"]}),
    ("Give the coordinates of a place.", {
        "type": "object",
        "properties": {"place": SHORT_TEXT, "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}},
        "required": ["place", "location"]}),
    ("Extract the key facts as a list of short strings: 'The bridge opened in 1932 and is 503 m long.'", {
        "type": "object",
        "properties": {"facts": {"type": "array", "minItems": 1, "maxItems": 3, "items": SHORT_TEXT}},
        "required": ["facts"]}),
    ("Give a payment: either a card (last four digits) or a bank transfer (IBAN).", {
        "type": "object",
        "properties": {"method": {"anyOf": [
            {"type": "object", "properties": {"card_last4": {"type": "string", "pattern": "^[0-9]{4}$"}},
             "required": ["card_last4"]},
            {"type": "object", "properties": {"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{4,12}$"}},
             "required": ["iban"]}]},
            "amount": {"type": "integer", "minimum": 1}},
        "required": ["method", "amount"]}),
    ("Summarise the task status as JSON.", {
        "type": "object",
        "properties": {"task": SHORT_TEXT, "done": {"type": "boolean"},
                       "progress_percent": {"type": "integer", "minimum": 0, "maximum": 100},
                       "blocked_by": {"type": ["string", "null"], "maxLength": 30}},
        "required": ["task", "done", "progress_percent", "blocked_by"]}),
]
