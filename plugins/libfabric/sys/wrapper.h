/* Everything the xfer libfabric backend calls: the core API and the shim over its static
 * inline data-path calls. */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include "shim.h"
