-- How a Tinker session ended, as its client reported it (`ServiceClient.close`, leaving its `with` block):
-- `success`, `errored` or `interrupted`, with an optional detail. The first report wins.
ALTER TABLE tinker_sessions
    ADD COLUMN finished_at   timestamptz,
    ADD COLUMN finish_reason text,
    ADD COLUMN finish_detail text;
