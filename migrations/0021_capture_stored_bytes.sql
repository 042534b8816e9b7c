-- Captured calls stored compactly (`gateway.capture.codec`), and the bytes each organisation keeps in capture
-- metered over time (byte-seconds), to be priced and billed as tokens are.

-- Form 0: every field as JSON, as migrations 0018-0019 wrote them (rows written before this migration keep
-- it and read as they did). Form 1: only what the other columns do not give back (`derived` says which
-- fields are left out), token ids as 16- or 32-bit integers and logprobs as float32 in the binary
-- columns.
ALTER TABLE captured_completions ADD COLUMN form smallint NOT NULL DEFAULT 0;
ALTER TABLE captured_completions ADD COLUMN derived integer NOT NULL DEFAULT 0;
ALTER TABLE captured_completions ADD COLUMN prompt_ids bytea;
ALTER TABLE captured_completions ADD COLUMN completion_ids bytea;
ALTER TABLE captured_completions ADD COLUMN logprob_values bytea;

-- The settings of an episode's first call (all its request but messages and model), once per episode: a form 1
-- record of the episode keeps only the settings that differ (`gateway.capture.codec`). Kept as long as the
-- episode's longest-kept record.
CREATE TABLE capture_request_bases (
    organization_id text NOT NULL,
    episode_id      text NOT NULL,
    settings        jsonb NOT NULL,
    expires_at      timestamptz,
    PRIMARY KEY (organization_id, episode_id)
);
CREATE INDEX capture_request_bases_expiry ON capture_request_bases (expires_at) WHERE expires_at IS NOT NULL;

-- What each organisation keeps in capture: `bytes`, the stored bytes of its records that were live at
-- `metered_at`; `pending`, the byte-seconds accrued up to then and not yet moved into a usage row.
CREATE TABLE capture_storage (
    organization_id text PRIMARY KEY,
    bytes           bigint NOT NULL DEFAULT 0,
    metered_at      timestamptz NOT NULL,
    pending         double precision NOT NULL DEFAULT 0
);

-- Stored bytes over time, as completion_usage is for tokens: byte-seconds accrued up to `created_at`.
CREATE TABLE capture_storage_usage (
    id              bigserial PRIMARY KEY,
    organization_id text NOT NULL,
    created_at      timestamptz NOT NULL,
    byte_seconds    bigint NOT NULL,
    billed          boolean NOT NULL DEFAULT false
);
CREATE INDEX capture_storage_usage_org_time ON capture_storage_usage (organization_id, created_at);
CREATE INDEX capture_storage_usage_unbilled ON capture_storage_usage (id) WHERE NOT billed;

-- Accrue an organisation's stored bytes up to `at`: the bytes live at `metered_at`, less those of records
-- that expired since, each from its expiry on. Locks the organisation's row until the transaction ends.
CREATE FUNCTION capture_storage_accrue(org text, at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    kept capture_storage%ROWTYPE;
    gone bigint;
    gone_seconds double precision;
BEGIN
    INSERT INTO capture_storage (organization_id, metered_at) VALUES (org, at) ON CONFLICT DO NOTHING;
    SELECT * INTO kept FROM capture_storage WHERE organization_id = org FOR UPDATE;
    IF at <= kept.metered_at THEN
        RETURN;
    END IF;
    SELECT coalesce(sum(stored_bytes), 0), coalesce(sum(stored_bytes * extract(epoch FROM at - expires_at)), 0)
    INTO gone, gone_seconds
    FROM captured_completions
    WHERE organization_id = org AND expires_at > kept.metered_at AND expires_at <= at;
    UPDATE capture_storage
    SET bytes = bytes - gone,
        pending = pending + bytes * extract(epoch FROM at - kept.metered_at) - gone_seconds,
        metered_at = at
    WHERE organization_id = org;
END $$;

-- Every change to the records keeps `capture_storage.bytes` right: accrue up to now, then count the bytes
-- of the record as it is now (a new one, one whose size or expiry changed) and stop counting the old one.
-- A record written already past its retention is never counted.
CREATE FUNCTION capture_storage_change() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := clock_timestamp();
    org text := CASE WHEN TG_OP = 'DELETE' THEN OLD.organization_id ELSE NEW.organization_id END;
    delta bigint := 0;
BEGIN
    PERFORM capture_storage_accrue(org, at);
    SELECT metered_at INTO at FROM capture_storage WHERE organization_id = org;
    IF TG_OP <> 'INSERT' AND (OLD.expires_at IS NULL OR OLD.expires_at > at) THEN
        delta := delta - OLD.stored_bytes;
    END IF;
    IF TG_OP <> 'DELETE' AND (NEW.expires_at IS NULL OR NEW.expires_at > at) THEN
        delta := delta + NEW.stored_bytes;
    END IF;
    IF delta <> 0 THEN
        UPDATE capture_storage SET bytes = bytes + delta WHERE organization_id = org;
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

-- Inserts after the row (a row `ON CONFLICT DO NOTHING` skips is not counted); updates and deletes before it,
-- so that the accrual still sees the record as it was.
CREATE TRIGGER capture_storage_insert AFTER INSERT ON captured_completions
    FOR EACH ROW EXECUTE FUNCTION capture_storage_change();
CREATE TRIGGER capture_storage_update BEFORE UPDATE OF stored_bytes, expires_at ON captured_completions
    FOR EACH ROW EXECUTE FUNCTION capture_storage_change();
CREATE TRIGGER capture_storage_delete BEFORE DELETE ON captured_completions
    FOR EACH ROW EXECUTE FUNCTION capture_storage_change();

-- One organisation's metering: accrued up to `at`, its whole byte-seconds moved into a usage row; whether a
-- row was made. A pass runs it for each organisation in a transaction of its own (`gateway.usage.storage`).
CREATE FUNCTION capture_storage_meter(org text, at timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    whole bigint;
BEGIN
    PERFORM capture_storage_accrue(org, at);
    SELECT floor(pending)::bigint INTO whole FROM capture_storage WHERE organization_id = org;
    IF whole <= 0 THEN
        RETURN false;
    END IF;
    INSERT INTO capture_storage_usage (organization_id, created_at, byte_seconds) VALUES (org, at, whole);
    UPDATE capture_storage SET pending = pending - whole WHERE organization_id = org;
    RETURN true;
END $$;

-- What the records written before this migration keep, from now on.
INSERT INTO capture_storage (organization_id, bytes, metered_at)
SELECT organization_id, coalesce(sum(stored_bytes) FILTER (WHERE expires_at IS NULL OR expires_at > now()), 0),
       now()
FROM captured_completions GROUP BY organization_id;
