"""Pieces shared by the l2fs master, worker and client, one module per job (paths, net, sizes, errors, rpc,
auth, blockkey, crc, metrics; capability, protocol, fdpass). The names are re-exported here so
`from l2fs.common import X` keeps working."""

from l2fs.common.auth import (  # noqa: F401
    ADMINS,
    READERS,
    REMOVERS,
    ROLES,
    SHA256_HEX,
    WORKER_ID_SEP,
    WORKERS,
    WRITERS,
    Credential,
    Credentials,
    FileToken,
    TokenInterceptor,
    TokensFileError,
    load_token_entries,
    load_tokens_file,
    new_worker_id,
    token_digest,
    worker_node,
)
from l2fs.common.blockkey import (  # noqa: F401
    BLOCK_KEY_MIN,
    BlockKey,
    BlockKeyError,
    ensure_block_key,
    load_block_key,
    new_block_key,
)
from l2fs.common.crc import (  # noqa: F401
    CrcPipeline,
    Scatter,
    crc32c_fast,
    crc_pieces,
)
from l2fs.common.errors import (  # noqa: F401
    ERROR_KIND_KEY,
    PathError,
    RpcError,
)
from l2fs.common.fileio import SHARED_POPULATED, pwrite_all  # noqa: F401
from l2fs.common.metrics import (  # noqa: F401
    start_metrics_server,
)
from l2fs.common.net import (  # noqa: F401
    free_port,
    parse_masters,
    parse_shard,
    valid_address,
    write_port_file,
)
from l2fs.common.paths import (  # noqa: F401
    BLOCK_ID,
    MAX_NAME_LEN,
    MAX_PATH_LEN,
    _norm_path_checked,
    check_block_id,
    norm_path,
    parent_of,
    shard_of,
)
from l2fs.common.rpc import (  # noqa: F401
    CLIENT_OPTIONS,
    FRAME,
    GRPC_OPTIONS,
    MAX_BATCH_ITEMS,
    MAX_MSG,
    MAX_STREAMS,
    auth_metadata,
    check_batch,
    grpc_server,
    make_channel,
    rpc_handler,
    server_credentials,
    wait_for_stop_signal,
)
from l2fs.common.sizes import (  # noqa: F401
    DEFAULT_MAX_FILE_SIZE,
    parse_size,
)
